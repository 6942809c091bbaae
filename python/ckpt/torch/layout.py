"""Which tensors a rank registers with ckptd, and in which layers.

The automatic layer grouping (default_layer_of), the checks that refuse a
tensor ckptd cannot map, FSDP2's sharded parameters, and Layout: the
model's parameters, optimizer state and persistent buffers of one rank,
grouped into layers, with the part each data-parallel replica writes.
A Layout is used by one thread (the training loop's)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "U8",  # one byte each, stored as bytes
}

_BLOCK = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<kind>layers|h|blocks|block|layer)\.(?P<n>\d+)\.")
_EMBEDDING = re.compile(r"(^|\.)(\w*emb\w*|wte|wpe)$")
_NORM = re.compile(r"(^|\.)(ln_f|norm|norm_f|final_norm|final_layer_norm|final_layernorm)$")
_HEAD = re.compile(r"(^|\.)(lm_head|head|output|classifier)$")

_STATE_ROLES = {"exp_avg": "EXP_AVG", "exp_avg_sq": "EXP_AVG_SQ", "momentum_buffer": "MOMENTUM",
                "max_exp_avg_sq": "OTHER"}

LayerOf = Callable[[str], Union[str, Tuple[str, str]]]


def default_layer_of(name: str) -> Tuple[str, str]:
    """(layer name, layer kind) of a parameter or buffer under the automatic
    grouping: ``*.layers.N.*``, ``*.h.N.*``, ``*.blocks.N.*`` are blocks;
    embeddings, the final norm and the head are layers of their own."""
    m = _BLOCK.match(name)
    if m:
        return m.group("prefix") + m.group("kind") + "." + m.group("n"), "BLOCK"
    module = name.rsplit(".", 1)[0] if "." in name else name
    if _EMBEDDING.search(module):
        return module, "EMBEDDING"
    if _NORM.search(module):
        return module, "NORM"
    if _HEAD.search(module):
        return module, "HEAD"
    return module, "OTHER"


def check_mappable(name: str, t: torch.Tensor) -> None:
    """Raises ValueError naming `name` when ckptd cannot map `t`."""
    if t.layout != torch.strided:
        raise ValueError(f"tensor '{name}' is {t.layout}; ckptd maps only dense (strided) tensors")
    if t.device.type == "meta":
        raise ValueError(f"tensor '{name}' is a meta tensor (no data); materialize the model first")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor '{name}' is on {t.device}; ckpt.torch maps CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"tensor '{name}' is not contiguous; make it contiguous before attach")
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor '{name}' has dtype {t.dtype}, which ckptd does not store")


def instance_of(obj: Any, module: str, name: str) -> bool:
    """isinstance(obj, module.name) for a class a torch build may lack."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, cls)


_DTENSOR: List[Any] = []  # the DTensor class, looked up once (None: this torch has none)


def is_dtensor(t: Any) -> bool:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0] is not None and isinstance(t, _DTENSOR[0])


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard (FSDP2's
    fully_shard), else the tensor itself. The shard object is the one the
    DTensor keeps, so moving its storage moves the DTensor's."""
    return t._local_tensor if is_dtensor(t) else t


def fsdp_shards(model: torch.nn.Module) -> Dict[int, torch.Tensor]:
    """id(sharded parameter) -> the padded flat shard FSDP2 keeps for it
    (its all-gathers read that one; the parameter's local tensor views it)."""
    out: Dict[int, torch.Tensor] = {}
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or ():
            padded = getattr(fp, "_sharded_param_data", None)
            if padded is not None:
                out[id(fp.sharded_param)] = padded
    return out


def dim0_rows(rows: int, world_size: int, rank: int) -> Tuple[int, int]:
    """[begin, end) of the rows FSDP2 gives `rank` of a dimension of `rows`
    (torch.chunk: ceil(rows / world_size) each, the last ones shorter or
    empty)."""
    c = -(-rows // world_size)
    return min(rows, rank * c), min(rows, (rank + 1) * c)


def spread(layer_bytes: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Which rank writes each layer of a replicated (data-parallel) model:
    the largest layers first, each to the rank with the fewest bytes so far
    (ties to the lowest rank), so every rank writes about 1/world_size of the
    bytes. A pure function of the layers and the world size: every replica
    computes the same answer."""
    load = [0] * world_size
    owner: Dict[str, int] = {}
    order = sorted(enumerate(layer_bytes.items()), key=lambda x: (-x[1][1], x[0]))
    for _, (name, nbytes) in order:
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += nbytes
    return owner


# Where a registered tensor lives in the model or the optimizer, so that it
# can be found again after registration (guard.py, buffers.py): a parameter
# or a buffer by its name, an optimizer state tensor by its parameter's name
# and its key; None for a tensor ckpt.torch made itself.
Source = Optional[Tuple[str, ...]]  # ("param", name) | ("buffer", name) | ("state", name, key)


class ModelTensor(NamedTuple):
    """A tensor of the model or its optimizer, whole, before registration."""
    name: str
    tensor: torch.Tensor
    layer: str
    kind: str
    frozen: bool
    spec: Dict[str, Any]  # role, optimizer group and hyper-parameters
    source: Source


@dataclasses.dataclass
class Entry:
    """One registered tensor: where it lives and how ckptd sees it."""
    name: str
    tensor: torch.Tensor
    layer: str
    spec: Dict[str, Any]
    # The flat tensor whose storage `tensor` views and which must move with
    # it (FSDP2's padded shard, which its all-gathers read); None when the
    # tensor owns its storage.
    base: Optional[torch.Tensor] = None
    source: Source = None


class Built(NamedTuple):
    """The layout Layout.build() computed, registered or not yet."""
    entries: List[Entry]             # every tensor of this rank
    layers: Dict[str, dict]          # every layer, in first-appearance order
    by_layer: Dict[str, List[Entry]]
    layer_bytes: Dict[str, int]
    owners: Dict[str, int]           # replicated: layer -> the rank writing it
    own_entries: List[Entry]         # what this rank registers
    own_layers: Dict[str, dict]


Param = Tuple[str, torch.nn.Parameter, Optional[int]]  # name, parameter, optimizer group


class Layout:
    """The tensors of one rank of a model and optimizer, and their layers.

    Made at attach(): the parameters (with the optimizer group stepping
    each, or None), the persistent buffers and the one device they are on,
    each checked mappable. build() groups every tensor into layers once the
    optimizer state exists; adopt() makes that the registered layout."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 layer_of: Optional[LayerOf], world_size: int, rank: int, replicated: bool):
        self._model = model
        self._optimizer = optimizer
        self._layer_of = layer_of
        self.world_size = world_size
        self.rank = rank
        self.replicated = replicated  # data-parallel replicas: each layer written by one rank
        self.params: List[Param] = self._collect_params()
        self.param_ids = {id(p) for _, p, _ in self.params}
        self.sharded = any(is_dtensor(p) for _, p, _ in self.params)  # FSDP2
        self.buffers = self._collect_buffers()
        self.device = self._one_device()
        # The registered layout (adopt()): every entry of each layer, each
        # layer's bytes, the layers' names and the frozen ones.
        self.entries: List[Entry] = []
        self.by_layer: Dict[str, List[Entry]] = {}
        self.layer_bytes: Dict[str, int] = {}
        self.layer_names: List[str] = []
        self.frozen_layers: List[str] = []
        self.owners: Dict[str, int] = {}

    def _collect_params(self) -> List[Param]:
        """(name, parameter, optimizer group or None) in model order."""
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(self._optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        params = list(self._model.named_parameters())
        names = {id(p) for _, p in params}
        if any(i not in names for i in group_of):
            raise ValueError("the optimizer holds a parameter that is not in the model")
        out = []
        for name, p in params:
            check_mappable(name, local(p))
            out.append((name, p, group_of.get(id(p))))
        return out

    def _collect_buffers(self) -> List[Tuple[str, torch.Tensor]]:
        """Persistent buffers (those a state_dict holds)."""
        persistent = set(self._model.state_dict(keep_vars=True))
        out = []
        for name, b in self._model.named_buffers():
            if b is None or name not in persistent:
                continue
            check_mappable(name, b)
            out.append((name, b))
        return out

    def _one_device(self) -> torch.device:
        seen: Dict[torch.device, str] = {}
        for name, t in [(n, p) for n, p, _ in self.params] + self.buffers:
            seen.setdefault(t.device, name)
        if len(seen) > 1:
            where = ", ".join(f"'{n}' on {d}" for d, n in seen.items())
            raise ValueError(
                "ckpt.torch registers the tensors of one device per rank; this model has "
                f"tensors on {len(seen)} devices ({where}): move it to one device, or give each "
                "device its own rank")
        return next(iter(seen)) if seen else torch.device("cpu")

    def trained(self) -> List[Param]:
        """Parameters the optimizer steps: in it and requiring grad (decided
        at registration; see hooks.FrozenGuard)."""
        return [(n, p, gi) for n, p, gi in self.params if gi is not None and p.requires_grad]

    def frozen_in_optimizer(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """Parameters in the optimizer that do not require grad now."""
        return [(n, p) for n, p, gi in self.params if gi is not None and not p.requires_grad]

    def layer(self, name: str) -> Tuple[str, str]:
        """(layer, kind) of a parameter or buffer name."""
        if self._layer_of is None:
            return default_layer_of(name)
        got = self._layer_of(name)
        return got if isinstance(got, tuple) else (got, "OTHER")

    def model_tensors(self) -> List[ModelTensor]:
        """Every tensor the rank registers, in registration order, each whole
        (a DTensor, of its global shape, for FSDP2 parameters and their
        optimizer state), with its layer and what ckptd is told about it. A
        frozen parameter goes to '<layer>.frozen'."""
        groups = self._optimizer.param_groups
        base_lr = float(groups[0]["lr"]) or 1.0
        out: List[ModelTensor] = []
        for name, p, gi in self.params:
            if p.numel() == 0:
                continue  # nothing to keep
            lname, kind = self.layer(name)
            if gi is None or not p.requires_grad:
                out.append(ModelTensor(name, p, lname + ".frozen", kind, True, {"role": "PARAM"},
                                       ("param", name)))
                continue
            g = groups[gi]
            betas = g.get("betas", (0.0, 0.0))
            out.append(ModelTensor(name, p, lname, kind, False, {
                "role": "PARAM", "group": gi, "lr_scale": float(g["lr"]) / base_lr,
                "weight_decay": g.get("weight_decay", 0.0), "beta1": float(betas[0]),
                "beta2": float(betas[1]), "eps": g.get("eps", 0.0)}, ("param", name)))
            state = self._optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if key != "step" and torch.is_tensor(v) and v.shape == p.shape:
                    out.append(ModelTensor(f"{name}.{key}", v, lname, kind, False, {
                        "role": _STATE_ROLES.get(key, "OTHER"), "group": gi, "param": name},
                        ("state", name, key)))
        for name, b in self.buffers:
            if b.numel() > 0:
                lname, kind = self.layer(name)
                out.append(ModelTensor(name, b, lname, kind, False, {"role": "OTHER"},
                                       ("buffer", name)))
        return out

    def _entries(self) -> Tuple[List[Entry], Dict[str, dict]]:
        """Every tensor to register (this rank's part of each), and the
        layers in first-appearance order."""
        layers: Dict[str, dict] = {}
        entries: List[Entry] = []
        shards = fsdp_shards(self._model)
        for m in self.model_tensors():
            layer = layers.setdefault(m.layer, {"name": m.layer, "kind": m.kind,
                                                "frozen": m.frozen, "tensors": []})
            part = local(m.tensor)
            if part.numel() == 0:
                continue  # an empty shard (a dimension smaller than the world)
            check_mappable(m.name, part)
            base = shards.get(id(m.tensor))
            if base is not None and base.untyped_storage().data_ptr() != \
                    part.untyped_storage().data_ptr():
                base = None  # the shard owns its storage
            spec = dict(m.spec, name=m.name, dtype=DTYPE_NAMES[part.dtype],
                        shape=list(part.shape) or [1])
            entries.append(Entry(m.name, part, m.layer, spec, base, m.source))
            layer["tensors"].append(spec)
        for lname, layer in layers.items():
            if not layer["tensors"]:
                # Every tensor of the layer is an empty shard on this rank.
                # The layer stays (every rank registers the same layers, in
                # the same order, for the drift all-reduce) with one byte.
                entries.append(self._pad_entry(lname, layer, lname + ".pad"))
        return entries, layers

    def _pad_entry(self, lname: str, layer: dict, name: str) -> Entry:
        spec = {"name": name, "dtype": "U8", "shape": [1], "role": "OTHER"}
        layer["tensors"].append(spec)
        return Entry(name, torch.zeros(1, dtype=torch.uint8, device=self.device), lname, spec)

    def build(self) -> Built:
        """The layout from the model and the optimizer state as they are now,
        and the part of it this rank registers (a replica: the layers it
        writes; every rank's layers otherwise)."""
        entries, layers = self._entries()
        by_layer: Dict[str, List[Entry]] = {name: [] for name in layers}
        for e in entries:
            by_layer[e.layer].append(e)
        layer_bytes = {name: sum(e.tensor.numel() * e.tensor.element_size() for e in es)
                       for name, es in by_layer.items()}
        owners: Dict[str, int] = {}
        own_entries, own_layers = entries, layers
        if self.replicated:
            owners = spread(layer_bytes, self.world_size)
            own_layers = {n: l for n, l in layers.items() if owners[n] == self.rank}
            own_entries = [e for e in entries if owners[e.layer] == self.rank]
            if not own_layers:
                # More replicas than layers: this rank writes no layer, only
                # the state saved with each step (its RNG, data position).
                lname = f"rank{self.rank}.state"
                layer = {"name": lname, "kind": "OTHER", "frozen": True, "tensors": []}
                own_layers, own_entries = {lname: layer}, [self._pad_entry(lname, layer, lname)]
        return Built(entries, layers, by_layer, layer_bytes, owners, own_entries, own_layers)

    def whole_bytes(self) -> Dict[str, int]:
        """Each layer's bytes over all ranks (DTensors at their global sizes)."""
        whole: Dict[str, int] = {}
        for m in self.model_tensors():
            whole[m.layer] = whole.get(m.layer, 0) + m.tensor.numel() * m.tensor.element_size()
        return whole

    def adopt(self, built: Built) -> None:
        """`built` is the registered layout from now on."""
        self.entries = built.entries
        self.by_layer = built.by_layer
        self.layer_bytes = built.layer_bytes
        self.owners = built.owners
        self.layer_names = list(built.layers)
        self.frozen_layers = [n for n, l in built.layers.items() if l["frozen"]]

    def names_for_messages(self) -> List[str]:
        """The layers' names for an error message, also before registration."""
        return self.layer_names or [self.layer(n)[0] for n, _, _ in self.params] or ["?"]

    def tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The registered tensors by layer: (name, the live tensor)."""
        return {layer: [(e.name, e.tensor) for e in es] for layer, es in self.by_layer.items()}

    def owned_layers(self) -> List[str]:
        """The layers this rank writes (see Attached.owned_layers)."""
        if not self.replicated:
            return list(self.layer_names)
        return [n for n in self.layer_names if self.owners.get(n) == self.rank]
