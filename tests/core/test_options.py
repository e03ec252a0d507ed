"""kvcopy.core.options: each copy option defined and checked once, reached by every
surface's keywords or options value."""
import pytest
import torch

import kvcopy
from kvcopy.core.options import ChecksumOptions, CopierOptions, CopyOptions
from kvcopy.nixl.options import ManagerOptions


def _tensors():
    return {"a": torch.arange(4 * 16 * 2 * 8, dtype=torch.float32).view(4, 16, 2, 8)}, \
        {"a": torch.full((4, 16, 2, 8), -7.0)}


@pytest.mark.parametrize("fields, error, match", [
    ({"copy_backend": ""}, ValueError, "copy_backend must be a backend name"),
    ({"copy_backend": 3}, TypeError, "copy_backend must be a backend name"),
    ({"max_ctas": 0}, ValueError, "max_ctas must be a positive integer"),
    ({"max_ctas": True}, TypeError, "max_ctas must be a positive integer"),
    ({"directions": "d2h"}, ValueError, "directions must be"),
    ({"directions": ()}, ValueError, "directions must be"),
    ({"directions": ("d2h", "up")}, ValueError, "directions must be"),
    ({"reinterpret_dtypes": 1}, TypeError, "reinterpret_dtypes must be True or False"),
])
def test_a_bad_field_is_refused_by_its_one_rule_on_every_path(fields, error, match):
    """The options type and the copier's keywords reach the same check."""
    with pytest.raises(error, match=match):
        CopierOptions(**fields)
    dev, host = _tensors()
    with pytest.raises(error, match=match):
        kvcopy.BlockCopier(dev, host, [["a"]], **fields)


def test_an_unknown_keyword_is_refused_naming_it_and_the_known_ones():
    dev, host = _tensors()
    with pytest.raises(TypeError, match=r"BlockCopier got unknown option\(s\) \['layout', 'nope'\]; "
                                        r"known: \['block_dim', 'copy_backend', 'directions'"):
        kvcopy.BlockCopier(dev, host, [["a"]], nope=1, layout="HND")
    with pytest.raises(TypeError, match="backend= is now copy_backend="):
        kvcopy.BlockCopier(dev, host, [["a"]], backend="torch")
    with pytest.raises(TypeError, match="positional argument"):  # options are keywords only
        kvcopy.BlockCopier(dev, host, [["a"]], "torch")
    with pytest.raises(TypeError, match=r"options must be a CopierOptions \(or another CopyOptions\), got dict"):
        kvcopy.BlockCopier(dev, host, [["a"]], options={"copy_backend": "torch"})


def test_a_keyword_overrides_the_same_field_of_options():
    """``options=`` and keywords combine; where both name a field the keyword wins, as
    for a TransferManager (the one ``CopyOptions.make``)."""
    dev, host = _tensors()
    base = CopierOptions(copy_backend="no_such_backend", max_ctas=3, directions=("d2h",))
    with pytest.raises(ValueError, match="no_such_backend"):
        kvcopy.BlockCopier(dev, host, [["a"]], options=base)
    with kvcopy.BlockCopier(dev, host, [["a"]], options=base, copy_backend="torch") as copier:
        assert copier.options == CopierOptions(copy_backend="torch", max_ctas=3, directions=("d2h",))
        assert copier.tables("d2h").max_ctas == 3
        copier.to_host([[2, 0]], [[1, 3]])
        assert torch.equal(host["a"][[1, 3]], dev["a"][[2, 0]])  # poisoned host, bit-exact rows
        assert (host["a"][[0, 2]] == -7.0).all()
        with pytest.raises(ValueError, match="built without the 'h2d' direction"):
            copier.to_device([[0]])
    assert base.max_ctas == 3 and base.copy_backend == "no_such_backend"  # frozen, untouched


@pytest.mark.parametrize("options", [CopyOptions(copy_backend="torch", max_ctas=5),
                                     ChecksumOptions(copy_backend="torch", max_ctas=5, checksum=False),
                                     ManagerOptions(copy_backend="torch", max_ctas=5, tp_size=2)])
def test_any_copy_options_gives_the_copier_its_copy_fields(options):
    """A surface hands its own options down (a manager its ManagerOptions): the copier
    takes the CopyOptions fields and its own defaults for the rest."""
    dev, host = _tensors()
    with kvcopy.BlockCopier(dev, host, [["a"]], options=options) as copier:
        assert copier.options == CopierOptions(copy_backend="torch", max_ctas=5)
        assert copier.copy_backend == "torch"
