"""The options every copying surface shares, each field defined and checked once (a value
of the wrong kind raises ``TypeError``, one out of range ``ValueError``).

:class:`CopyOptions` is how a surface copies (which copy backend, its grid cap, the
device views' layout), and :meth:`CopyOptions.make` the one way a surface combines an
options value with keywords. :class:`CopierOptions` adds what only a
:class:`~kvcopy.core.copier.BlockCopier` is built with (its directions, dtype
reinterpretation); :class:`ChecksumOptions` adds page sums. The surfaces' own types
extend them: ``ManagerOptions`` (:mod:`kvcopy.nixl.options`), ``OffloadOptions``
(:mod:`kvcopy.offload`), and through them the vLLM connectors' settings
(:mod:`kvcopy.vllm.config`). A surface may inherit a field it does not offer (the
offloading connector has no ``kv_layout`` key): which keys a user can set is the
surface's allowlist, not the type's fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Type, TypeVar

from ..checks import is_plain_int


Opts = TypeVar("Opts", bound="CopyOptions")


def check_max_ctas(value: Any, what: str = "max_ctas") -> int:
    """``value`` as a grid cap (a positive integer, not a bool), else ``TypeError``
    (not an integer) or ``ValueError`` (below 1): a copier's ``max_ctas`` and a
    call's (``BlockCopier.run(..., max_ctas=)``) are checked here alike."""
    if not is_plain_int(value) or value < 1:
        raise (ValueError if is_plain_int(value) else TypeError)(f"{what} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CopyOptions:
    """How a surface's :class:`~kvcopy.core.copier.BlockCopier` copies."""

    # kvcopy's copy backend ("auto": the measured choice per device and call); an unknown
    # name is refused where the copier is built, with the names available there
    copy_backend: str = "auto"
    max_ctas: Optional[int] = None  # grid cap of the kernel backends (None: kvcopy's default)
    kv_layout: str = "NHD"  # as for BlockCopier
    block_dim: Any = None  # as for BlockCopier: None, an int, or per layer

    def __post_init__(self) -> None:
        if not isinstance(self.copy_backend, str) or not self.copy_backend:
            raise (ValueError if self.copy_backend == "" else TypeError)(
                f"copy_backend must be a backend name, got {self.copy_backend!r}")
        if self.max_ctas is not None:
            check_max_ctas(self.max_ctas)

    @classmethod
    def make(cls: Type[Opts], options: Optional["CopyOptions"], overrides: Mapping[str, Any],
             surface: str = "") -> Opts:
        """``options`` (default: ``cls()``) with ``overrides`` by name, each field then
        checked by ``cls``; a keyword overrides the same field of ``options``. ``options``
        may also be another surface's :class:`CopyOptions` (a manager hands its
        ``ManagerOptions`` to its copiers): its copy fields are taken, the rest are
        ``cls``'s defaults. An unknown name raises ``TypeError`` naming it and the known
        ones (``surface``: who was given it, for the message)."""
        if options is not None and not isinstance(options, cls):
            if not isinstance(options, CopyOptions):
                raise TypeError(f"options must be a {cls.__name__} (or another CopyOptions), "
                                f"got {type(options).__name__}")
            options = cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(CopyOptions)})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"{surface or cls.__name__} got unknown option(s) {unknown}; known: {sorted(known)}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **overrides) if overrides else base


@dataclass(frozen=True)
class CopierOptions(CopyOptions):
    """Everything a :class:`~kvcopy.core.copier.BlockCopier` is built with besides its
    tensors and groups: :class:`CopyOptions` and these."""

    # the directions to build: a "d2h"-only copier accepts device bytes shared by layers
    # with different host buffers (reading shared bytes into separate buffers is well
    # defined), which the "h2d" tables refuse
    directions: Tuple[str, ...] = ("d2h", "h2d")
    # copy two different floating types of one element size as raw bits (else TypeError)
    reinterpret_dtypes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        d = self.directions
        if isinstance(d, str) or not isinstance(d, (tuple, list)) or not d or any(x not in ("d2h", "h2d") for x in d):
            raise ValueError(f"directions must be 'd2h' and/or 'h2d', got {d!r}")
        object.__setattr__(self, "directions", tuple(d))  # frozen: normalized once, here
        if not isinstance(self.reinterpret_dtypes, bool):
            raise TypeError(f"reinterpret_dtypes must be True or False, got {self.reinterpret_dtypes!r}")


@dataclass(frozen=True)
class ChecksumOptions(CopyOptions):
    """:class:`CopyOptions` with page sums (:mod:`kvcopy.core.checksum`): computed by the
    copies that write the host side, compared by those that read it."""

    checksum: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.checksum, bool):
            raise TypeError(f"checksum must be true or false, got {self.checksum!r}")

