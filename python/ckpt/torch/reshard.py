"""Moving restored layers between ranks, over the ranks' gloo group: a
replicated (DDP) layer from the rank that read it to the others, and
restore(from_job=) onto another world: replicated layers re-spread, FSDP2
dim-0 shards re-sliced. No shared file system: each rank reads only what its
own node's ckptd holds and the ranks hand it on."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

import ckpt

from .layout import Entry, Layout, ModelTensor, dim0_rows, is_dtensor, spread

# What a read of an old job gives: each layer's step, old rank 0's saved
# state, the bytes read on this rank.
Read = Tuple[Dict[str, int], bytes, int]


def check_step(plan: dict, source: str, rank: int, target: int) -> None:
    """ckpt.Error FAILED_PRECONDITION unless `plan` is of step `target`."""
    if plan["target_step"] != target:
        raise ckpt.Error("FAILED_PRECONDITION",
                         f"job {source} rank {rank} has no checkpoint of step {target} (its "
                         f"newest at or below is {plan['target_step']}): its ranks do not share "
                         "that step")


def check_reslicable(layout: Layout, source: str, old_world: int) -> None:
    """Before anything is registered or written: FSDP2 shards restore
    onto another world when this model is sharded too, on dim 0."""
    for name, p, _ in layout.params:
        layer = layout.layer(name)[0]
        if not is_dtensor(p):
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{layer}' of job {source} was saved as shards of {old_world} ranks and "
                f"'{name}' is not sharded here: fully_shard the model first")
        if any(not (pl.is_shard() and pl.dim == 0) for pl in p.placements):
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{layer}' tensor '{name}' is placed {p.placements}: only dim-0 "
                "shards re-slice onto another number of ranks")


class Exchange:
    """The ranks' collectives over restored layers. `group` is the gloo group
    (None: one rank, and nothing to exchange); `memory` is the rank's
    host_memory.HostMemory or gpu.GpuMemory. Collective methods run on every
    rank at the same point, on the training loop's thread."""

    def __init__(self, client: "ckpt.Client", group: Any, layout: Layout, memory: Any):
        self._client = client
        self._group = group
        self._layout = layout
        self._memory = memory

    def _src(self, rank: int) -> int:
        import torch.distributed as dist
        return dist.get_global_rank(self._group, rank)

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order ([obj] with one rank)."""
        if self._group is None:
            return [obj]
        import torch.distributed as dist
        out: List[Any] = [None] * self._layout.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_blob(self, blob: bytes, src: int) -> bytes:
        """Rank `src`'s `blob` on every rank."""
        if self._group is None:
            return blob
        import torch.distributed as dist
        box = [blob]
        dist.broadcast_object_list(box, src=self._src(src), group=self._group)
        return box[0]

    def broadcast_layers(self, owners: Optional[Dict[str, int]] = None) -> None:
        """After each rank restored what its own ckptd holds: each layer goes
        from the rank that read it (`owners`; default: the replicated
        layers' writers) to every other rank."""
        import torch.distributed as dist
        layout = self._layout
        owners = layout.owners if owners is None else owners
        with torch.no_grad():
            for lname, es in layout.by_layer.items():
                owner = owners[lname]
                sizes = [e.tensor.numel() * e.tensor.element_size() for e in es]
                if owner == layout.rank:
                    flat = torch.cat([e.tensor.detach().reshape(-1).view(torch.uint8).cpu()
                                      for e in es])
                else:
                    flat = torch.empty(sum(sizes), dtype=torch.uint8)
                dist.broadcast(flat, src=self._src(owner), group=self._group)
                if owner == layout.rank:
                    continue
                off = 0
                for e, n in zip(es, sizes):
                    e.tensor.reshape(-1).view(torch.uint8).copy_(flat[off:off + n])
                    off += n
        self._memory.synchronize()

    def read_replicated(self, source: str, old_world: int, reader: Dict[int, int],
                        target: int) -> Read:
        """Replicated layers (or one rank's) onto this world: each reader
        takes the layers its old ranks wrote straight into the registered
        tensors, then each layer goes from its reader to every rank."""
        layout = self._layout
        # The old layout's writers: the ranks were replicas of this model.
        writer = (spread(layout.layer_bytes, old_world) if old_world > 1
                  else {n: 0 for n in layout.layer_names})
        steps: Dict[str, int] = {}
        aux_blob = b""
        read = 0
        with torch.no_grad():
            for k in sorted(k for k, r in reader.items() if r == layout.rank):
                mine = [n for n in layout.layer_names if writer[n] == k]
                dests: Dict[str, Any] = {}
                staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
                for e in (e for n in mine for e in layout.by_layer[n]):
                    t = e.tensor
                    if t.device.type != "cpu":
                        host = torch.empty(t.numel(), dtype=t.dtype)
                        staged.append((host, t))
                        t = host
                    dests[e.name] = t.detach().reshape(-1).view(torch.uint8).numpy()
                if not mine:
                    dests[f"rank{k}.state"] = bytearray(1)  # an owner of no layer
                plan = self._client.export_into(source, k, target, dests)
                check_step(plan, source, k, target)
                for host, t in staged:
                    t.copy_(host.view(t.shape))
                steps.update({l["name"]: l["step"] for l in plan["layers"]})
                read += sum(layout.layer_bytes[n] for n in mine)
                if k == 0:
                    aux_blob = plan["aux"]
        if self._group is not None:
            self.broadcast_layers({n: reader[writer[n]] for n in layout.layer_names})
        return steps, aux_blob, read

    def reslice(self, source: str, old_world: int, reader: Dict[int, int], target: int) -> Read:
        """FSDP2 shards of `old_world` ranks onto this world: each reader
        takes its old ranks' shards from its node's ckptd; then, tensor by
        tensor, every old shard goes to every rank (one whole tensor in
        memory at a time) and each rank keeps its new dim-0 rows."""
        tensors = self._layout.model_tensors()
        scratch: Dict[Tuple[int, str], torch.Tensor] = {}
        steps: Dict[str, int] = {}
        aux_blob = b""
        read = 0
        for k in sorted(k for k, r in reader.items() if r == self._layout.rank):
            plan, nbytes = self._read_old_shards(source, old_world, k, target, tensors, scratch)
            steps.update({l["name"]: l["step"] for l in plan["layers"]})
            read += nbytes
            if k == 0:
                aux_blob = plan["aux"]
        entries = {e.name: e for e in self._layout.entries}
        with torch.no_grad():
            for t in tensors:
                self._reassemble(t, entries.get(t.name), old_world, reader, scratch)
        self._memory.synchronize()
        return steps, aux_blob, read

    def _read_old_shards(self, source: str, old_world: int, k: int, target: int,
                         tensors: List[ModelTensor],
                         scratch: Dict[Tuple[int, str], torch.Tensor]) -> Tuple[dict, int]:
        """Old rank k's tensors from this node's ckptd into `scratch` (its
        shards, and its buffers when k is 0); returns its plan and the bytes
        read."""
        dests: Dict[str, Any] = {}
        filled: Dict[str, bool] = {}
        read = 0
        for name, t, layer, *_ in tensors:
            filled.setdefault(layer, False)
            shape = tuple(t.shape)
            if is_dtensor(t):
                a, b = dim0_rows(shape[0], old_world, k)
                if a == b:
                    continue  # an empty shard: not registered
                shape = (b - a,) + shape[1:]
            buf = torch.empty(shape, dtype=t.dtype)
            if is_dtensor(t) or k == 0:  # buffers: rank 0's
                scratch[(k, name)] = buf
            dests[name] = buf.reshape(-1).view(torch.uint8).numpy()
            filled[layer] = True
            read += buf.numel() * buf.element_size()
        for layer, nonempty in filled.items():
            if not nonempty:
                dests[layer + ".pad"] = bytearray(1)
        plan = self._client.export_into(source, k, target, dests)
        check_step(plan, source, k, target)
        return plan, read

    def _reassemble(self, m: ModelTensor, e: Optional[Entry], old_world: int,
                    reader: Dict[int, int], scratch: Dict[Tuple[int, str], torch.Tensor]) -> None:
        """One tensor whole from the old shards (each broadcast by the rank
        that read it), and this rank's new rows of it into its entry `e`
        (None: its new shard here is empty)."""
        import torch.distributed as dist
        layout = self._layout
        name, t = m.name, m.tensor
        shape = tuple(t.shape)
        parts = ([(k,) + dim0_rows(shape[0], old_world, k) for k in range(old_world)]
                 if is_dtensor(t) else [(0, 0, 0)])
        whole = torch.empty(shape, dtype=t.dtype) if is_dtensor(t) else None
        for k, a, b in parts:
            if whole is not None and a == b:
                continue
            part = scratch.pop((k, name), None)
            if part is None:
                part = torch.empty((b - a,) + shape[1:] if whole is not None else shape,
                                   dtype=t.dtype)
            if self._group is not None:
                dist.broadcast(part, src=self._src(reader[k]), group=self._group)
            if whole is None:
                whole = part
            else:
                whole[a:b].copy_(part)
        if e is None:
            return  # this rank's new shard of it is empty
        if is_dtensor(t):
            a, b = dim0_rows(shape[0], layout.world_size, layout.rank)
            whole = whole[a:b]
        e.tensor.copy_(whole.reshape(e.tensor.shape))
