"""A hardware description: what the time model (`nanocore plan --hardware`) and MFU are measured against.

A small YAML file (`nanocore/hardware_specs/*.yaml` are the shipped ones, each figure cited to its
public datasheet; `nanocore calibrate` writes one for the machine at hand):

    name: h100-sxm
    source: where the figures come from
    peak_flops: {bfloat16: 989.4e+12, float32: 66.9e+12, ...}   # dense FLOP/s per device
    memory: 80GiB                    # per device (a number of bytes or a size such as 80GiB)
    memory_bandwidth: 3.35e+12       # bytes/s per device (optional: memory-bound work and the optimizer step)
    op_overhead: 5.0e-6              # seconds per launched non-matmul op (optional, default 0)
    compute_overlap: 1.0             # share of concurrent compute that hides communication (optional, default 1)
    devices_per_node: 8
    intra_node: {bandwidth: 450e9, latency: 5e-6}   # bytes/s per device one way; seconds per message
    inter_node: {bandwidth: 50e9, latency: 10e-6}
    # optional, per link: a kind of collective measured on its own (what `nanocore calibrate` writes);
    # kinds not listed use the link's two figures
    #   intra_node: {bandwidth: ..., latency: ..., collectives: {all_gather: {bandwidth: ..., latency: ...}}}
    matmul_efficiency: [[1e9, 0.25], [1e11, 0.7]]   # optional: (FLOPs of one matmul, fraction of peak)
    attention_efficiency:            # optional: the fused attention kernel's own curves
      forward: [[1e9, 0.3], [1e12, 0.35]]    # (forward FLOPs of one call, fraction of peak)
      backward: [[1e9, 0.25], [1e12, 0.3]]   # (the same call's forward FLOPs, fraction of peak for 2x them)

Bandwidth is a ring collective's *bus bandwidth* as nccl-tests reports it: the bytes each device
sends per second, so that an all-reduce of S bytes over n devices takes 2 (n-1)/n S / bandwidth
plus 2 (n-1) latencies (`Hardware.collective_seconds`). A group whose devices span nodes runs at the
inter-node figures. The efficiency curve is interpolated on log FLOPs and held flat beyond its ends;
without one every matmul runs at the peak. The attention core (scaled_dot_product_attention: a fused
kernel, not two matmuls) runs at `attention_efficiency` where the description has it: its backward
counts twice the forward's FLOPs, whatever the kernel recomputes (a flash kernel recomputes the
scores), so the backward curve absorbs that; without one it runs at the matmul curve, the backward
at twice the forward's time.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import attrs
import yaml

from nanocore.errors import ConfigError

DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
# ring steps of each collective over n devices (`Hardware.collective_seconds`); a send is one message
RING_STEPS: dict[str, Callable[[int], int]] = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1}
RING_STEPS |= {"all_gather": lambda n: n - 1, "all_to_all": lambda n: n - 1}


@attrs.frozen
class Link:
    """One kind of connection between devices: bus bandwidth (bytes/s per device, one direction) and
    the latency of one message step (seconds); `collectives`: kinds (COLLECTIVES) measured on their
    own, each with its own two figures in the same formula (a backend's all-gather need not run at
    its all-reduce's rate: gloo's on CPU moves a byte at about a third of it)."""

    bandwidth: float
    latency: float
    collectives: dict[str, Link] = attrs.field(factory=dict)

    def of(self, kind: str) -> Link:
        """The figures `kind` runs at: its own where measured, else the link's."""
        return self.collectives.get(kind, self)


@functools.lru_cache(maxsize=16)
def _log_sizes(curve: tuple[tuple[float, float], ...]) -> tuple[float, ...]:
    """The curve's matmul sizes on the log scale it is interpolated in (a search asks ~10^5 times)."""
    return tuple(math.log(max(x, 1.0)) for x, _ in curve)


def _interpolate(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """A (FLOPs, fraction of peak) curve at `flops`: log-interpolated, held flat beyond its ends."""
    xs = _log_sizes(curve)
    x = math.log(max(flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
    return curve[i - 1][1] + t * (curve[i][1] - curve[i - 1][1])


@attrs.frozen
class AttentionEfficiency:
    """The fused attention kernel's achieved fraction of the peak, per pass, over the forward FLOPs of
    one call (the causal half counted); the backward's fraction is of twice those FLOPs (what the
    model counts), whatever the kernel recomputes."""

    forward: tuple[tuple[float, float], ...]
    backward: tuple[tuple[float, float], ...]


@attrs.frozen
class Hardware:
    """A device type and how its devices are connected (see the module docstring)."""

    name: str
    source: str  # where the figures come from: datasheets, or `nanocore calibrate` and when
    peak_flops: dict[str, float]  # dtype name (DTYPES) -> dense FLOP/s per device
    memory_bytes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    memory_bandwidth: float | None = None
    matmul_efficiency: tuple[tuple[float, float], ...] = ()  # (FLOPs of one matmul, fraction of peak), sorted
    op_overhead: float = 0.0  # seconds one launched non-matmul op costs beyond its bytes (dispatch, launch)
    # the share of compute running beside a collective that hides it: 1 where communication has its
    # own engine (NCCL on a GPU), near 0 where compute and the collective share the same cores
    compute_overlap: float = 1.0
    attention_efficiency: AttentionEfficiency | None = None  # None: the attention core at the matmul curve

    def memory_bound_seconds(self, ops: float, size_bytes: float) -> float:
        """Time of `ops` non-matmul ops moving `size_bytes` bytes in all: each op's overhead plus the
        bytes at the memory bandwidth (0 for the bytes when the description has none)."""
        moved = size_bytes / self.memory_bandwidth if self.memory_bandwidth else 0.0
        return ops * self.op_overhead + moved

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s per device for matmuls in `dtype` (a torch dtype name; "tf32" for float32 on
        tensor cores)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        raise ConfigError(
            f"hardware {self.name!r} declares no peak_flops.{dtype} (it has: {', '.join(sorted(self.peak_flops))})"
        )

    def efficiency(self, flops: float) -> float:
        """Achieved fraction of the peak for one matmul of `flops` FLOPs (the curve, log-interpolated)."""
        return _interpolate(self.matmul_efficiency, flops) if self.matmul_efficiency else 1.0

    def matmul_seconds(self, flops: float, dtype: str) -> float:
        """Time of one matmul of `flops` FLOPs in `dtype` at the curve's efficiency for its size."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak(dtype) * self.efficiency(flops))

    def attention_seconds(self, flops: float, dtype: str, backward: bool = False) -> float:
        """Time of one attention-core call of `flops` forward FLOPs in `dtype`: its forward, or (with
        `backward`) its backward, which counts twice those FLOPs. At `attention_efficiency` where the
        description has it, else as one matmul of `flops` (the backward twice that)."""
        if flops <= 0:
            return 0.0
        curves = self.attention_efficiency
        if curves is None:
            return (2.0 if backward else 1.0) * self.matmul_seconds(flops, dtype)
        work = 2.0 * flops if backward else flops
        return work / (self.peak(dtype) * _interpolate(curves.backward if backward else curves.forward, flops))

    def link(self, group_size: int, stride: int = 1) -> Link:
        """The link a ring over `group_size` devices, `stride` ranks apart, runs at: NVLink-like within a
        node, the inter-node one as soon as the group spans nodes (ranks fill a node before the next)."""
        span = (group_size - 1) * stride + 1
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    def collective_seconds(self, kind: str, size_bytes: float, group_size: int, stride: int = 1) -> float:
        """Time of one collective over `group_size` devices, each holding `size_bytes` (all_reduce,
        reduce_scatter's input, all_gather's output, all_to_all's send buffer), or of one point-to-point
        message of `size_bytes` (kind "send"): ring algorithms, the alpha-beta model."""
        n = group_size
        if size_bytes <= 0 or (n <= 1 and kind != "send"):
            return 0.0
        link = self.link(max(n, 2), stride).of(kind)
        if kind == "send":
            return link.latency + size_bytes / link.bandwidth
        if kind not in RING_STEPS:
            raise ValueError(f"unknown collective {kind!r}")
        return RING_STEPS[kind](n) * (link.latency + size_bytes / n / link.bandwidth)


def parse_size(text: str, what: str) -> int:
    """'80GB', '80GiB', '1.5TB', '512MB' or a plain number of bytes. GB means 2**30 bytes here, as
    GPU memory is quoted (an "80 GB" H100 holds 80 GiB). `what` names the field in the error."""
    units = {"": 1, "B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20}
    units |= {"GB": 2**30, "GIB": 2**30, "TB": 2**40, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"{what}: cannot read {text!r}; write a size such as 80GB")
    return int(value * units[unit])


def shipped_names() -> list[str]:
    """The hardware descriptions shipped with nanocore (`--hardware NAME`)."""
    folder = resources.files("nanocore") / "hardware_specs"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_hardware(spec: str) -> Hardware:
    """A shipped name (`shipped_names()`) or the path of a YAML file (one `nanocore calibrate` wrote)."""
    if spec in shipped_names():
        text = (resources.files("nanocore") / "hardware_specs" / f"{spec}.yaml").read_text()
        return parse_hardware(yaml.safe_load(text), f"hardware {spec!r}")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"hardware {spec!r}: neither a shipped name ({', '.join(shipped_names())}) nor a file; "
            "`nanocore calibrate --world-size N --output FILE` writes one for this machine"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    return parse_hardware(data, str(path))


def _number(value: object, where: str, problems: list[str], positive: bool = True) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]  # YAML reads 1e9 (no dot, no sign) as a string
    except (TypeError, ValueError):
        problems.append(f"{where}: expected a number, got {value!r}")
        return math.nan
    if positive and not number > 0:
        problems.append(f"{where}: expected a positive number, got {value!r}")
    return number


def _link(raw: dict, where: str, problems: list[str]) -> Link:
    return Link(
        _number(raw.get("bandwidth"), f"{where}.bandwidth", problems),
        _number(raw.get("latency", 0.0), f"{where}.latency", problems, positive=False),
    )


def _link_yaml(link: Link) -> dict[str, object]:
    out: dict[str, object] = {"bandwidth": link.bandwidth, "latency": link.latency}
    if link.collectives:
        out["collectives"] = {k: {"bandwidth": v.bandwidth, "latency": v.latency} for k, v in link.collectives.items()}
    return out


def parse_hardware(data: object, origin: str) -> Hardware:
    """A `Hardware` from parsed YAML; every problem named by its YAML path, all in one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of hardware fields, got {type(data).__name__}")
    problems: list[str] = []
    known = {
        "name",
        "source",
        "peak_flops",
        "memory",
        "memory_bandwidth",
        "devices_per_node",
        "intra_node",
        "inter_node",
        "matmul_efficiency",
        "op_overhead",
        "compute_overlap",
        "attention_efficiency",
        "measured",
    }
    for key in data:
        if key not in known:
            problems.append(f"{origin}: {key}: unknown field (known: {', '.join(sorted(known))})")
    for key in ("name", "peak_flops", "memory", "devices_per_node", "intra_node", "inter_node"):
        if key not in data:
            problems.append(f"{origin}: {key}: missing")
    peaks: dict[str, float] = {}
    raw_peaks = data.get("peak_flops", {})
    if not isinstance(raw_peaks, dict) or not raw_peaks:
        problems.append(f"{origin}: peak_flops: expected a mapping of dtype to FLOP/s ({', '.join(DTYPES)})")
    else:
        for dtype, value in raw_peaks.items():
            if dtype not in DTYPES:
                problems.append(f"{origin}: peak_flops.{dtype}: unknown dtype (one of {', '.join(DTYPES)})")
            peaks[str(dtype)] = _number(value, f"{origin}: peak_flops.{dtype}", problems)
    memory = 0
    if "memory" in data:
        raw_memory = data["memory"]
        try:
            memory = int(raw_memory) if isinstance(raw_memory, int | float) else parse_size(str(raw_memory), "memory")
        except ConfigError:
            problems.append(f"{origin}: memory: cannot read {data['memory']!r}; write bytes or a size such as 80GiB")
    links = {}
    for key in ("intra_node", "inter_node"):
        raw = data.get(key, {})
        if not isinstance(raw, dict):
            problems.append(f"{origin}: {key}: expected {{bandwidth: bytes/s, latency: seconds}}")
            raw = {}
        kinds: dict[str, Link] = {}
        raw_kinds = raw.get("collectives") or {}
        if not isinstance(raw_kinds, dict):
            problems.append(f"{origin}: {key}.collectives: expected a mapping of collective to its figures")
            raw_kinds = {}
        for kind, figures in raw_kinds.items():
            where = f"{origin}: {key}.collectives.{kind}"
            if kind not in COLLECTIVES:
                problems.append(f"{where}: unknown collective (one of {', '.join(COLLECTIVES)})")
            elif not isinstance(figures, dict):
                problems.append(f"{where}: expected {{bandwidth: bytes/s, latency: seconds}}")
            else:
                kinds[str(kind)] = _link(figures, where, problems)
        for extra in set(raw) - {"bandwidth", "latency", "collectives"}:
            problems.append(f"{origin}: {key}.{extra}: unknown field (known: bandwidth, collectives, latency)")
        links[key] = attrs.evolve(_link(raw, f"{origin}: {key}", problems), collectives=kinds)
    devices = data.get("devices_per_node", 1)
    if not isinstance(devices, int) or devices < 1:
        problems.append(f"{origin}: devices_per_node: expected a positive integer, got {devices!r}")
    bandwidth = data.get("memory_bandwidth")
    memory_bandwidth = None if bandwidth is None else _number(bandwidth, f"{origin}: memory_bandwidth", problems)
    overhead = _number(data.get("op_overhead", 0.0), f"{origin}: op_overhead", problems, positive=False)
    if overhead < 0:
        problems.append(f"{origin}: op_overhead: expected seconds >= 0, got {data['op_overhead']!r}")
    overlap = _number(data.get("compute_overlap", 1.0), f"{origin}: compute_overlap", problems, positive=False)
    if not math.isnan(overlap) and not 0 <= overlap <= 1:
        problems.append(f"{origin}: compute_overlap: expected a share from 0 to 1, got {data['compute_overlap']!r}")
    curve = _curve(data.get("matmul_efficiency") or [], f"{origin}: matmul_efficiency", "one matmul", problems)
    attention = None
    raw_attention = data.get("attention_efficiency")
    if raw_attention is not None:
        where = f"{origin}: attention_efficiency"
        if not isinstance(raw_attention, dict) or set(raw_attention) != {"forward", "backward"}:
            pairs = "[[FLOPs, fraction of peak], ...]"
            problems.append(f"{where}: expected {{forward: {pairs}, backward: {pairs}}}")
        else:
            passes = [
                _curve(raw_attention[key], f"{where}.{key}", "one call's forward", problems)
                for key in ("forward", "backward")
            ]
            if not all(passes):
                problems.append(f"{where}: each pass needs at least one [FLOPs, fraction of peak] point")
            attention = AttentionEfficiency(tuple(sorted(passes[0])), tuple(sorted(passes[1])))
    if problems:
        raise ConfigError(problems)
    return Hardware(
        name=str(data["name"]),
        source=str(data.get("source", "")).strip(),
        peak_flops=peaks,
        memory_bytes=memory,
        devices_per_node=int(devices),
        intra_node=links["intra_node"],
        inter_node=links["inter_node"],
        memory_bandwidth=memory_bandwidth,
        matmul_efficiency=tuple(sorted(curve)),
        op_overhead=overhead,
        compute_overlap=overlap,
        attention_efficiency=attention,
    )


def _curve(raw: object, where: str, what: str, problems: list[str]) -> list[tuple[float, float]]:
    """[(FLOPs, fraction of peak), ...] from YAML; problems named by their YAML path."""
    if not isinstance(raw, list):
        problems.append(f"{where}: expected a list of [FLOPs, fraction of peak] pairs")
        return []
    curve = []
    for i, point in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(point, list | tuple) or len(point) != 2:
            problems.append(f"{at}: expected [FLOPs of {what}, fraction of peak], got {point!r}")
            continue
        flops, fraction = _number(point[0], at, problems), _number(point[1], at, problems)
        if fraction > 1:
            problems.append(f"{at}: a fraction of the peak above 1 ({fraction}): raise peak_flops instead")
        curve.append((flops, fraction))
    return curve


def hardware_to_yaml(hw: Hardware, measured: dict[str, object] | None = None) -> str:
    """The YAML `load_hardware` reads back (what `nanocore calibrate` writes); `measured`: raw figures kept
    beside the description for the record."""
    data: dict[str, object] = {
        "name": hw.name,
        "source": hw.source,
        "peak_flops": {k: float(v) for k, v in hw.peak_flops.items()},
        "memory": int(hw.memory_bytes),
        "devices_per_node": hw.devices_per_node,
        "intra_node": _link_yaml(hw.intra_node),
        "inter_node": _link_yaml(hw.inter_node),
        "matmul_efficiency": [[float(f), float(e)] for f, e in hw.matmul_efficiency],
    }
    if hw.memory_bandwidth is not None:
        data["memory_bandwidth"] = hw.memory_bandwidth
    if hw.op_overhead:
        data["op_overhead"] = hw.op_overhead
    if hw.compute_overlap != 1.0:
        data["compute_overlap"] = hw.compute_overlap
    if hw.attention_efficiency is not None:
        data["attention_efficiency"] = {
            k: [[float(f), float(e)] for f, e in getattr(hw.attention_efficiency, k)] for k in ("forward", "backward")
        }
    if measured:
        data["measured"] = measured
    return yaml.safe_dump(data, sort_keys=False)
