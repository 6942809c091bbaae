"""ckpt.torch: protect a PyTorch training loop with ckptd in a few lines.

    import ckpt
    from ckpt import torch as ckpt_torch

    client = ckpt.Client("/run/ckptd/ckptd.sock")
    run = ckpt_torch.attach(model, optimizer, client, job_id="llama-ft-7",
                            policy="layercheck", scheduler=scheduler)
    if resuming:
        plan = run.restore()                      # composite restore, in place
        cursor = plan["data_position"]
    for batch in data(cursor):
        loss = model(batch).backward()
        run.set_data_position(cursor)             # saved with this step
        optimizer.step()                          # fence before, StepDone after
        scheduler.step()

attach() moves every parameter and its optimizer state (AdamW, Adam, SGD with
momentum) into shared memory that ckptd maps once: each tensor keeps its
identity (`param.data` is swapped), so the optimizer, hooks and references
held elsewhere keep working. Parameters are grouped into layers by name
(`*.layers.N.*`, `*.h.N.*`, `*.blocks.N.*`, embeddings, the final norm, the
head; a tied head is one tensor) unless `layers` says otherwise.

optimizer.step() is wrapped (torch 1.13 has no optimizer hooks): before the
step it waits until ckptd has copied the previous step (the fence; normally
the copy finished during forward/backward), after it it reports the step with
a small aux blob: the torch and `random` (and numpy, when imported) RNG
states, the learning rates, the optimizer step counts, the scheduler state,
the data position and `extra_state`. restore() writes the composite
checkpoint into the live tensors and puts all of that back, so training
continues at plan["target_step"] + 1 exactly as it would have.
"""

import pickle
import random
import re
import sys
import time

import torch

import ckpt

__all__ = ["Attached", "attach", "default_layer_of"]

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
_ALIGN = 64  # every tensor starts on a cache line
_AUX_VERSION = 1

_BLOCK = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<kind>layers|h|blocks|block|layer)\.(?P<n>\d+)\.")
_EMBEDDING = re.compile(r"(^|\.)(\w*emb\w*|wte|wpe)$")
_NORM = re.compile(r"(^|\.)(ln_f|norm|norm_f|final_norm|final_layer_norm|final_layernorm)$")
_HEAD = re.compile(r"(^|\.)(lm_head|head|output|classifier)$")


def default_layer_of(param_name):
    """(layer name, layer kind) of a parameter under the automatic grouping."""
    m = _BLOCK.match(param_name)
    if m:
        return m.group("prefix") + m.group("kind") + "." + m.group("n"), "BLOCK"
    module = param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    if _EMBEDDING.search(module):
        return module, "EMBEDDING"
    if _NORM.search(module):
        return module, "NORM"
    if _HEAD.search(module):
        return module, "HEAD"
    return module, "OTHER"


def _optimizer_kind(optimizer):
    # AdamW first: it is not an Adam subclass in every torch release.
    if isinstance(optimizer, torch.optim.AdamW):
        return "ADAMW", ("exp_avg", "exp_avg_sq")
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM", ("exp_avg", "exp_avg_sq")
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD", ("momentum_buffer",)
    raise TypeError(
        f"ckpt.torch supports torch.optim.AdamW, Adam and SGD, not {type(optimizer).__name__}")


_STATE_ROLES = {"exp_avg": "EXP_AVG", "exp_avg_sq": "EXP_AVG_SQ", "momentum_buffer": "MOMENTUM",
                "max_exp_avg_sq": "OTHER"}


def _check_mappable(name, t):
    if t.layout != torch.strided:
        raise ValueError(f"tensor '{name}' is {t.layout}; ckptd maps only dense (strided) tensors")
    if t.device.type == "meta":
        raise ValueError(f"tensor '{name}' is a meta tensor (no data); materialize the model first")
    if t.device.type != "cpu":
        raise ValueError(f"tensor '{name}' is on {t.device}; ckpt.torch maps CPU tensors "
                         "(GPU tensors go through ckpt.Client.add_gpu_tensor)")
    if not t.is_contiguous():
        raise ValueError(f"tensor '{name}' is not contiguous; make it contiguous before attach")
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"tensor '{name}' has dtype {t.dtype}, which ckptd does not store")


def _init_state(optimizer, param, kind, state_names):
    """Creates the optimizer state of `param` the way the optimizer's first
    step would, so it can live in shared memory from the start."""
    state = optimizer.state[param]
    if len(state) > 0:
        return
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if kind in ("ADAMW", "ADAM"):
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if group.get("amsgrad", False):
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    elif kind == "SGD" and group.get("momentum", 0) != 0:
        # With dampening 0 (the default) the first step then sets the buffer to
        # the gradient, exactly like the lazily created one.
        if group.get("dampening", 0) != 0:
            raise ValueError("ckpt.torch needs SGD dampening=0 (the buffer is created up front)")
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _parse_policy(policy, kind, layercheck, record_trace):
    spec = {"record_trace": bool(record_trace)}
    if policy.startswith("every_n:"):
        spec["kind"] = "EVERY_N"
        spec["every_n"] = int(policy.split(":", 1)[1])
    elif policy in ("all", "none", "explicit", "layercheck"):
        spec["kind"] = policy.upper()
    else:
        raise ValueError(f"unknown policy '{policy}': all, every_n:K, layercheck, explicit or none")
    if policy == "layercheck":
        spec["optimizer"] = kind
        spec["layercheck"] = dict(layercheck or {})
    return spec


class Attached:
    """A model and optimizer attached to ckptd (see attach())."""

    def __init__(self, model, optimizer, client, job_id, rank, world_size, policy, layercheck,
                 layers, scheduler, record_trace):
        self.client = client
        self.job_id = job_id
        self.rank = rank
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra_state = {}
        self._data_position = None
        self._step = 0
        self._fence_wait_s = []
        self._step_done_s = []
        kind, state_names = _optimizer_kind(optimizer)
        self._kind = kind
        self._spec, self._region = self._move_into_shared_memory(
            model, optimizer, kind, state_names, layers)
        self._spec.update(job_id=job_id, rank=rank, world_size=world_size,
                          policy=_parse_policy(policy, kind, layercheck, record_trace))
        client.register(self._spec)
        self._original_step = optimizer.step
        wrapped = self._wrap(optimizer.step)
        optimizer.step = wrapped

    # ---- set-up ----

    def _move_into_shared_memory(self, model, optimizer, kind, state_names, layer_of):
        params = list(model.named_parameters())
        names = {id(p): n for n, p in params}
        group_of = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                if id(p) not in names:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                group_of[id(p)] = gi
        for name, p in params:
            _check_mappable(name, p.data)
            if id(p) not in group_of:
                raise ValueError(f"parameter '{name}' is not in the optimizer")
        for name, p in params:
            _init_state(optimizer, p, kind, state_names)
        base_lr = optimizer.param_groups[0]["lr"] or 1.0

        # Layers in first-appearance order; every tensor at an aligned offset.
        layers = {}
        plan = []  # (holder, key, tensor, layer, tensor spec)
        offset = 0
        for name, p in params:
            if layer_of is None:
                lname, lkind = default_layer_of(name)
            else:
                got = layer_of(name)
                lname, lkind = got if isinstance(got, tuple) else (got, "OTHER")
            layer = layers.setdefault(lname, {"name": lname, "kind": lkind, "tensors": []})
            g = optimizer.param_groups[group_of[id(p)]]
            betas = g.get("betas", (0.0, 0.0))
            pspec = {"name": name, "role": "PARAM", "group": group_of[id(p)],
                     "lr_scale": g["lr"] / base_lr, "weight_decay": g.get("weight_decay", 0.0),
                     "beta1": betas[0], "beta2": betas[1], "eps": g.get("eps", 0.0)}
            plan.append((p, None, p.data, layer, pspec))
            state = optimizer.state[p]
            for key in sorted(state):
                value = state[key]
                if key == "step" or not torch.is_tensor(value) or value.shape != p.shape:
                    continue
                _check_mappable(f"{name}.{key}", value)
                sspec = {"name": f"{name}.{key}", "role": _STATE_ROLES.get(key, "OTHER"),
                         "group": group_of[id(p)], "param": name}
                plan.append((state, key, value, layer, sspec))
        for _, _, t, _, _ in plan:
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN + t.numel() * t.element_size()
        region = self.client.allocate_region(max(offset, 1))
        offset = 0
        for holder, key, t, layer, tspec in plan:
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
            view = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset)
            view = view.view(t.shape)
            view.copy_(t)
            if key is None:
                holder.data = view  # the Parameter object stays the same
            else:
                holder[key] = view
            tspec.update(dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape), region=region.index,
                         offset=offset)
            layer["tensors"].append(tspec)
            offset += t.numel() * t.element_size()
        self._params = [p for _, p in params]
        self._layer_names = list(layers)
        return {"layers": list(layers.values())}, region

    def _wrap(self, step_fn):
        def step(*args, **kwargs):
            if self._step > 0:
                t0 = time.perf_counter()
                self.client.wait_snapshot(self._step)  # the fence: step t-1 is copied
                self._fence_wait_s.append(time.perf_counter() - t0)
            result = step_fn(*args, **kwargs)
            t = self._step + 1
            aux = pickle.dumps(self._aux(t), protocol=4)
            t0 = time.perf_counter()
            self.client.step_done(t, float(self.optimizer.param_groups[0]["lr"]), aux, [],
                                  self._group_steps())
            self._step_done_s.append(time.perf_counter() - t0)
            self._step = t
            return result

        # LR schedulers check for this marker on optimizer.step.
        if hasattr(step_fn, "_with_counter"):
            step._with_counter = step_fn._with_counter
        return step

    # ---- per step ----

    def _group_steps(self):
        steps = []
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                s = self.optimizer.state[p].get("step")
                if s is not None:
                    steps.append((gi, int(s.item() if torch.is_tensor(s) else s)))
                    break
        return steps

    def _aux(self, step):
        aux = {"version": _AUX_VERSION, "step": step,
               "torch_rng": torch.get_rng_state(), "py_random": random.getstate(),
               "lrs": [g["lr"] for g in self.optimizer.param_groups],
               "group_steps": self._group_steps(),
               "data_position": self._data_position, "extra": self.extra_state}
        if "numpy" in sys.modules:
            aux["numpy_rng"] = sys.modules["numpy"].random.get_state()
        if self.scheduler is not None:
            aux["scheduler"] = self.scheduler.state_dict()
        return aux

    # ---- public ----

    @property
    def step(self):
        """The last step reported to ckptd (0 before the first)."""
        return self._step

    @property
    def layer_names(self):
        return list(self._layer_names)

    def set_data_position(self, position):
        """A small picklable object saved with the next step (a data cursor)."""
        self._data_position = position

    def plan(self, step=None):
        """The composite plan for `step` (None = latest durable) as a dict."""
        return self.client.plan(step or 0)

    def restore(self, step=None):
        """Restores the composite checkpoint for `step` (None = the latest
        durable one) into the live tensors, and the RNG states, learning
        rates, optimizer step counts, scheduler and data position saved with
        it. Raises ckpt.Error NOT_FOUND when the job has no checkpoint."""
        reply = self.client.restore(step or 0)
        aux = pickle.loads(reply["aux"]) if reply["aux"] else {}
        if aux.get("version") == _AUX_VERSION:
            torch.set_rng_state(aux["torch_rng"])
            random.setstate(aux["py_random"])
            if "numpy_rng" in aux and "numpy" in sys.modules:
                sys.modules["numpy"].random.set_state(aux["numpy_rng"])
            for g, lr in zip(self.optimizer.param_groups, aux["lrs"]):
                g["lr"] = lr
            for gi, s in aux["group_steps"]:
                for p in self.optimizer.param_groups[gi]["params"]:
                    st = self.optimizer.state[p].get("step")
                    if torch.is_tensor(st):
                        st.fill_(s)
                    elif st is not None:
                        self.optimizer.state[p]["step"] = s
            if self.scheduler is not None and "scheduler" in aux:
                # Saved after optimizer.step() and before the loop's
                # scheduler.step(); replay that one.
                self.scheduler.load_state_dict(aux["scheduler"])
                self.scheduler.step()
            self._data_position = aux["data_position"]
            self.extra_state = aux["extra"]
        self._step = reply["target_step"]
        return {"target_step": reply["target_step"], "max_staleness": reply["max_staleness"],
                "size_weighted_staleness": reply["size_weighted_staleness"],
                "data_position": self._data_position, "bytes_restored": reply["bytes_restored"],
                "seconds": reply["seconds"],
                "layers": [{"name": l["name"], "step": l["step"], "staleness": l["staleness"],
                            "bytes": l["bytes"]} for l in reply["layers"]]}

    def wait_durable(self):
        """Waits until everything reported so far is durable; returns that step."""
        return self.client.wait_durable(self._step)

    def stats(self):
        """Trainer-visible cost per step: fence waits and StepDone calls (seconds)."""
        return {"fence_wait_s": list(self._fence_wait_s), "step_done_s": list(self._step_done_s)}

    def close(self, drain=True):
        """Unregisters (after the staged steps are durable when `drain`) and
        unwraps optimizer.step. The tensors stay in the shared memory."""
        self.optimizer.step = self._original_step
        self.client.unregister(drain)


def attach(model, optimizer, client, job_id, rank=0, world_size=1, policy="all",
           layercheck=None, layers=None, scheduler=None, record_trace=False):
    """Attaches `model` and `optimizer` to ckptd through `client` and returns
    an Attached. `policy`: "all", "every_n:K", "layercheck", "explicit" or
    "none"; `layercheck`: its parameters (k0, k0_embedding, k_floor, s_max,
    warmup, warmup_interval, full_every); `layers`: None for the automatic
    grouping, or a callable param_name -> layer name (or (name, kind)).
    Raises ValueError naming the tensor for parameters ckptd cannot map
    (sparse, meta, non-CPU, non-contiguous) and ckpt.Error for refusals by
    ckptd."""
    if not isinstance(client, ckpt.Client):
        raise TypeError("client must be a ckpt.Client")
    return Attached(model, optimizer, client, job_id, rank, world_size, policy, layercheck,
                    layers, scheduler, record_trace)
