"""Types of ckpt._ckpt, the C++ client (client/include/ckpt/client.h)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, TypedDict, Union

__version__: str               # the project's version, as ckptd's Status reports it

class TensorSpec(TypedDict, total=False):
    name: str                  # required
    shape: List[int]           # required
    dtype: str                 # F32 (default), F16, BF16, F64, I64, I32, U8
    role: str                  # PARAM (default), MASTER, EXP_AVG, EXP_AVG_SQ, MOMENTUM, OTHER
    group: int                 # optimizer parameter group
    region: int                # Region.index, or the region of add_gpu_tensor
    offset: int                # bytes into the region
    param: str                 # a state tensor names its weight tensor
    lr_scale: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

class LayerSpec(TypedDict, total=False):
    name: str                  # required
    tensors: List[TensorSpec]  # required
    kind: str                  # EMBEDDING, BLOCK (default), NORM, HEAD, OTHER
    frozen: bool               # never changes: written once, never selected

class LayerCheckSpec(TypedDict, total=False):
    k0: float
    k0_embedding: float
    k_floor: float
    s_max: int
    warmup: int
    warmup_interval: int
    full_every: int

class PolicySpec(TypedDict, total=False):
    kind: str                  # ALL (default), EVERY_N, EXPLICIT, NONE, LAYERCHECK
    every_n: int
    optimizer: str             # ADAMW, ADAM, SGD, CLIENT (layercheck)
    layercheck: LayerCheckSpec
    record_trace: bool

class RankSpec(TypedDict, total=False):
    job_id: str                # required
    layers: List[LayerSpec]    # required
    rank: int
    world_size: int
    policy: PolicySpec
    job_nodes: List[str]       # each rank's node (Client.node()), in rank order

class PlannedLayer(TypedDict):
    layer: int
    name: str
    has_version: bool
    step: int
    staleness: int
    bytes: int
    source: str  # in a restore's reply: "memory" (the memory tier) or "disk"; "" in a plan
    lost_step: int  # non-zero: that step's version was lost; `step` is older (older_within)

class PlanDict(TypedDict):
    job_id: str
    rank: int
    target_step: int
    complete: bool
    total_bytes: int
    max_staleness: int
    size_weighted_staleness: float
    aux: bytes
    layers: List[PlannedLayer]

class RestoreDict(PlanDict):
    bytes_restored: int
    seconds: float

class SnapshotDict(TypedDict):
    layers: List[int]  # the layers taken at the step
    skipped: int       # selected but not taken (staging full)
    lost: bool       # the step was reported before ckptd restarted

def dtype_sizes() -> Dict[str, int]: ...  # {"F32": 4, ...}: every dtype a TensorSpec may name

class Region:
    """A memfd region of the client, writable through the buffer protocol."""
    @property
    def index(self) -> int: ...
    @property
    def size(self) -> int: ...

class Client:
    def __init__(self, socket_path: str = ..., call_timeout_s: float = ...,
                 wait_timeout_s: float = ..., restore_timeout_s: float = ...,
                 on_daemon_loss: str = ..., reconnect_interval_s: float = ...) -> None: ...
    def allocate_region(self, bytes: int) -> Region: ...
    def add_gpu_tensor(self, ptr: int, bytes: int, name: str) -> Tuple[int, int]: ...
    def set_cuda_stream(self, stream: int) -> None: ...
    def register(self, spec: RankSpec) -> None: ...
    # This node's name as ckptd's peer placement knows it (RankSpec's
    # job_nodes holds each rank's).
    def node(self) -> str: ...
    def step_done(self, step: int, lr: float, aux: bytes = ..., layers: Sequence[int] = ...,
                  group_steps: Sequence[Tuple[int, int]] = ...,
                  global_durable_step: Optional[int] = ...) -> None: ...
    def wait_snapshot(self, step: int) -> SnapshotDict: ...
    def wait_durable(self, step: int, tier: str = "local") -> int: ...
    def drift_partials(self, step: int) -> List[Tuple[float, float]]: ...
    def set_global_drift(self, step: int, sums: Sequence[Tuple[float, float]]) -> None: ...
    # older_within: a layer whose version at the target was lost (damaged, no
    # intact copy in any tier) takes its previous version when at most that
    # many steps older; 0 refuses (DATA_LOSS, reason "LOST_VERSION").
    def plan(self, target_step: int = 0, job_id: Optional[str] = None, rank: int = 0,
             older_within: int = 0) -> PlanDict: ...
    # dests: tensor name, or (layer name, tensor name) where two layers of
    # the checkpoint share a tensor name, -> a writable contiguous buffer.
    def export_into(self, job_id: str, rank: int, target_step: int,
                    dests: Dict[Union[str, Tuple[str, str]], Any],
                    older_within: int = 0) -> PlanDict: ...
    def restore(self, target_step: int = 0, discard_later: bool = False,
                older_within: int = 0) -> RestoreDict: ...
    def unregister(self, drain: bool = True) -> None: ...
    @property
    def generation(self) -> int: ...
    @property
    def latest_durable_step_at_register(self) -> int: ...
    @property
    def unprotected(self) -> bool: ...
    @property
    def on_daemon_loss(self) -> str: ...  # "error" or "continue", as given
