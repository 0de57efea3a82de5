"""What the machine can do: a frozen record, probed once, injectable in tests.

Backends gate on the exact capability their kernel uses (an ISA flag, an op and its
schema), never on a proxy such as "is an Intel CPU". Ops are answered for any name: the
detected machine asks torch's op registry at the time of the question (a vendor's op
registered with ``torch.library`` after detection is found), a simulated one answers from
the schemas it was built with.
"""

from __future__ import annotations

import functools
import platform
import threading
from typing import Any, Iterable, Mapping

import attrs
import torch

def _ops_converter(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in items))


@attrs.frozen(slots=True)
class Capabilities:
    """A frozen description of the machine and its software.

    ``detect()`` reads the real machine once; tests build their own instances to
    simulate CPUs we do not have (see ``Capabilities.preset``).
    """

    cpu_vendor: str = "unknown"  # "AMD", "Intel", "ARM" or "unknown"
    cpu_model: str = ""
    arch: str = "unknown"  # platform.machine(): "x86_64", "aarch64"...
    cpu_family: int | None = None
    cpu_model_id: int | None = None
    zen_generation: int | None = None  # 1..5 on AMD Zen, else None
    avx2: bool = False
    fma_f16c: bool = False  # FMA3 and F16C (with AVX2 on every x86 CPU since Haswell / Zen 1)
    avx512: bool = False  # avx512f
    avx512_bw_vl: bool = False  # AVX-512 BW and VL (byte/word ops, 256-bit forms)
    avx512_bf16: bool = False
    avx512_vnni: bool = False  # int8 dot products (vpdpbusd) on 512-bit registers
    avx512_fp16: bool = False
    amx_tile: bool = False
    amx_bf16: bool = False
    amx_fp16: bool = False
    mkldnn: bool = False  # torch was built with oneDNN and can use it here
    threads: int = 1
    torch_version: str = torch.__version__
    # Op schemas this record answers from ("ns::name[.overload]" -> schema string).
    ops: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_ops_converter)
    # True for the detected machine: an op not in ``ops`` is looked up in torch's registry.
    live_ops: bool = False

    @property
    def is_amd_zen(self) -> bool:
        return self.cpu_vendor == "AMD" and self.zen_generation is not None

    def op_schema(self, name: str) -> str | None:
        """The schema string of op ``"ns::name[.overload]"``, or None if it is absent.

        Any namespace: on the detected machine the op is looked up when asked, so a backend
        gates on its own vendor's op with nothing else to declare.
        """
        for op_name, schema in self.ops:
            if op_name == name:
                return schema
        if not self.live_ops:
            return None
        schema = probe_op(name)
        asked = getattr(_ASKED, "names", None)
        if asked is not None:  # a resolution is recording which ops its gates looked up
            asked[name] = schema
        return schema

    def has_op(self, name: str) -> bool:
        return self.op_schema(name) is not None

    def fingerprint(self) -> str:
        """A short stable string naming this machine's relevant capabilities."""
        flags = [f for f in ("avx2", "avx512", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                             "amx_tile", "amx_bf16", "amx_fp16", "mkldnn") if getattr(self, f)]
        zen = f"zen{self.zen_generation}" if self.zen_generation else "-"
        return (f"{self.cpu_vendor}/{zen}/{self.arch}/{'+'.join(flags) or 'none'}/"
                f"torch{self.torch_version}")

    def evolve(self, **changes: Any) -> "Capabilities":
        """A copy with some fields changed (tests simulate other machines with it)."""
        return attrs.evolve(self, **changes)

    @classmethod
    def detect(cls) -> "Capabilities":
        """Probe the real machine. Computed once per process and cached."""
        return _detect()

    @classmethod
    def preset(cls, name: str, **changes: Any) -> "Capabilities":
        """A simulated machine: ``sapphire_rapids``, ``ice_lake``, ``zen3``, ``zen4``, ``zen5``,
        ``neoverse_v1``. It knows no ops unless given ``ops={name: schema}``; ``torch_version``
        is this process's."""
        from ._errors import InvalidArgumentError  # _errors is light; kept out of import time

        key = name.strip().lower() if isinstance(name, str) else name
        if key not in _PRESETS:
            raise InvalidArgumentError("preset", name, f"one of {', '.join(sorted(_PRESETS))}")
        return attrs.evolve(_PRESETS[key], **changes)


def zen_generation(family: int | None, model: int | None) -> int | None:
    """Map an AMD CPUID family/model to the Zen generation (None if not Zen).

    Family 0x17 is Zen 1/+/2, 0x19 is Zen 3/3+/4, 0x1A is Zen 5 (AMD's published
    model ranges; Zen+ and Zen 3+ are reported as 1 and 3).
    """
    if family is None or model is None:
        return None
    if family == 0x17:
        return 2 if model >= 0x30 else 1
    if family == 0x19:
        if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF:
            return 4
        return 3
    if family == 0x1A:
        return 5
    return None


def _read_cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo, or {} where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


# Ops once found stay registered for the life of the process, so found schemas are
# memoised; absent ones are asked again (a library may register them later).
_FOUND: dict[str, str] = {}
_ASKED = threading.local()


class record_ops:  # noqa: N801 - used as a context manager, named for what it does
    """Within this block, remember every live op lookup (name -> schema or None): the
    resolver keys its cache on the answers the gates actually got."""

    def __enter__(self) -> dict[str, str | None]:
        self.previous = getattr(_ASKED, "names", None)
        _ASKED.names = {}
        return _ASKED.names

    def __exit__(self, *exc: object) -> None:
        _ASKED.names = self.previous


def probe_op(qualified: str) -> str | None:
    """The schema of op ``"ns::name[.overload]"`` registered in this process, or None."""
    found = _FOUND.get(qualified)
    if found is not None:
        return found
    ns, sep, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    if not (sep and ns and name):
        return None
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        schema = str(getattr(packet, overload or "default")._schema)
    except (AttributeError, RuntimeError):
        return None
    _FOUND[qualified] = schema
    return schema


def _torch_probe(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:  # a probe that fails means "not available", never a crash
        return False


@functools.lru_cache(maxsize=1)
def _detect() -> Capabilities:
    info = _read_cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    vendor_id = info.get("vendor_id", "")
    arch = platform.machine() or "unknown"
    if vendor_id == "AuthenticAMD":
        vendor = "AMD"
    elif vendor_id == "GenuineIntel":
        vendor = "Intel"
    elif arch in ("aarch64", "arm64") or "CPU implementer" in info:
        vendor = "ARM"
    else:
        vendor = "unknown"

    def _int(key: str) -> int | None:
        raw = info.get(key)
        try:
            return int(raw, 0) if raw is not None else None
        except ValueError:
            return None

    family, model = _int("cpu family"), _int("model")
    zen = zen_generation(family, model) if vendor == "AMD" else None

    # ISA flags: torch's probes check OS support too; cpuinfo fills in what torch lacks.
    return Capabilities(
        cpu_vendor=vendor,
        cpu_model=info.get("model name", platform.processor() or ""),
        arch=arch,
        cpu_family=family,
        cpu_model_id=model,
        zen_generation=zen,
        avx2=_torch_probe("_is_avx2_supported") or "avx2" in flags,
        fma_f16c={"fma", "f16c"} <= flags,
        avx512=_torch_probe("_is_avx512_supported"),
        avx512_bw_vl=_torch_probe("_is_avx512_supported") and {"avx512bw", "avx512vl"} <= flags,
        avx512_bf16=_torch_probe("_is_avx512_bf16_supported"),
        # torch has no VNNI probe: the cpuinfo flag, where the OS enables AVX-512 at all.
        avx512_vnni=_torch_probe("_is_avx512_supported") and "avx512_vnni" in flags,
        avx512_fp16="avx512_fp16" in flags,
        amx_tile=_torch_probe("_is_amx_tile_supported"),
        amx_bf16="amx_bf16" in flags,
        amx_fp16=_torch_probe("_is_amx_fp16_supported"),
        mkldnn=bool(torch.backends.mkldnn.is_available()),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        live_ops=True,
    )


def _preset_table() -> dict[str, Capabilities]:
    sw: dict[str, Any] = dict(threads=2, torch_version=torch.__version__, mkldnn=True)
    spr = Capabilities(cpu_vendor="Intel", cpu_model="Intel(R) Xeon(R) Platinum 8480+",
                       arch="x86_64", cpu_family=6, cpu_model_id=0x8F, avx2=True, avx512=True,
                       fma_f16c=True, avx512_bw_vl=True,
                       avx512_bf16=True, avx512_vnni=True, avx512_fp16=True, amx_tile=True,
                       amx_bf16=True, **sw)
    icx = Capabilities(cpu_vendor="Intel", cpu_model="Intel(R) Xeon(R) Platinum 8380",
                       arch="x86_64", cpu_family=6, cpu_model_id=0x6A, avx2=True, avx512=True,
                       fma_f16c=True, avx512_bw_vl=True,
                       avx512_vnni=True, **sw)
    zen3 = Capabilities(cpu_vendor="AMD", cpu_model="AMD EPYC 7763", arch="x86_64",
                        cpu_family=0x19, cpu_model_id=0x01, zen_generation=3, avx2=True,
                        fma_f16c=True, **sw)
    zen4 = Capabilities(cpu_vendor="AMD", cpu_model="AMD EPYC 9654", arch="x86_64",
                        cpu_family=0x19, cpu_model_id=0x11, zen_generation=4, avx2=True,
                        fma_f16c=True, avx512=True, avx512_bw_vl=True, avx512_bf16=True,
                        avx512_vnni=True, **sw)
    zen5 = zen4.evolve(cpu_model="AMD EPYC 9755", cpu_family=0x1A, cpu_model_id=0x02,
                       zen_generation=5)
    neoverse = Capabilities(cpu_vendor="ARM", cpu_model="Neoverse-V1", arch="aarch64", **sw)
    return {"sapphire_rapids": spr, "ice_lake": icx, "zen3": zen3, "zen4": zen4,
            "zen5": zen5, "neoverse_v1": neoverse}


_PRESETS = _preset_table()
