"""kvcopy never needs vLLM; kvcopy.vllm names the vLLM version it needs (any env)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_kvcopy_does_not_import_vllm():
    r = _run("import sys, kvcopy; kvcopy.copy_blocks; print('vllm' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_import_kvcopy_vllm_with_another_vllm_names_the_version():
    r = _run(
        "import sys, types\n"
        "fake = types.ModuleType('vllm'); fake.__version__ = '0.32.1'; sys.modules['vllm'] = fake\n"
        "try:\n"
        "    import kvcopy.vllm\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "ImportError: kvcopy.vllm needs vLLM 0.33.x, found vLLM 0.32.1" in r.stdout


def test_import_kvcopy_vllm_without_vllm_names_the_version():
    r = _run(
        "import sys\n"
        "sys.modules['vllm'] = None  # import vllm -> ImportError, as where it is not installed\n"
        "try:\n"
        "    import kvcopy.vllm\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "ImportError: kvcopy.vllm needs vLLM 0.33.x (pip install 'vllm==0.33.0')" in r.stdout
