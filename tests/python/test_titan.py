"""ckpt.titan against a real ckptd, on the CPU: torchtitan's checkpoint
manager seam (BaseCheckpointManager, 0.3), driven the way torchtitan's
trainer drives it (Config.build with the trainer's states, load(-1) before
the loop, maybe_wait_for_staging() before each optimizer step, save(step,
last_step) after it, close()), on a tiny Llama of transformers with AdamW
and a schedule wrapped as torchtitan's containers wrap them.
- a run killed with SIGKILL right after an async save, resumed by a new
  process with load(-1), ends bitwise as a run never killed;
- load(step) of the last step's checkpoint gives the final weights; a step
  never saved is refused; a job with no checkpoint loads nothing (False).
torchtitan's own trainer needs packages this environment does not install
(datasets, torchdata, spmd_types, ...): see docs/dcp.md.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or torchtitan
is missing.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch("transformers", "torchtitan.components.checkpointer.base")
import torch  # noqa: E402

STEPS, INTERVAL = 12, 3


def weights_hash(model, opt):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for p in model.parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            h.update(k.encode() + v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(a):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import LlamaConfig, LlamaForCausalLM

    from ckpt.titan import CkptCheckpointManager

    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    class Optimizers(Stateful):  # as torchtitan's OptimizersContainer
        def state_dict(self):
            return get_optimizer_state_dict(model, opt, options=flat)

        def load_state_dict(self, sd):
            set_optimizer_state_dict(model, opt, optim_state_dict=sd, options=flat)

    class Schedulers(Stateful):  # as torchtitan's LRSchedulersContainer
        def state_dict(self):
            return sched.state_dict()

        def load_state_dict(self, sd):
            sched.load_state_dict(sd)

    class TrainState(Stateful):  # the trainer itself, in torchtitan
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    ts = TrainState()
    config = CkptCheckpointManager.Config(enable=True, job_id=a.job, socket_path=a.socket,
                                          interval=INTERVAL, last_save_model_only=False)
    mgr = config.build(dataloader=None, model_parts=[model], optimizers=Optimizers(),
                       lr_schedulers=Schedulers(), states={"train_state": ts})
    if a.load_step:
        try:
            mgr.load(step=a.load_step)
        except FileNotFoundError as e:
            print(json.dumps({"refused": str(e)}), flush=True)
            return
        print(json.dumps({"loaded": a.load_step, "hash": weights_hash(model, opt)}), flush=True)
        return
    loaded = mgr.load(step=-1)
    print(json.dumps({"loaded": loaded, "from": ts.step}), flush=True)
    for step in range(ts.step + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        mgr.maybe_wait_for_staging()
        opt.step()
        sched.step()
        opt.zero_grad()
        ts.step = step
        mgr.save(step, last_step=(step == STEPS))
        if step == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    print(json.dumps({"final": weights_hash(model, opt)}), flush=True)


def run(daemon, job, *extra, killed=False):
    p = subprocess.run([sys.executable, __file__, "--train", "--job", job, "--socket",
                        daemon.socket] + list(extra), capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    want = -signal.SIGKILL if killed else 0
    check(p.returncode == want, "%s %s exits %d: %s" % (job, extra, p.returncode,
                                                      p.stderr[-3000:]))
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", action="store_true")
    p.add_argument("--job")
    p.add_argument("--socket")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--load-step", type=int, default=0)
    a = p.parse_args()
    if a.train:
        train(a)
        return
    root = harness.tempdir("ckpt-titan-")
    daemon = harness.Daemon(root).start()
    try:
        whole = run(daemon, "titan-whole")
        check(whole[0] == {"loaded": False, "from": 0}, "a job with no checkpoint loads nothing")
        run(daemon, "titan-killed", "--kill-at", "9", killed=True)
        resumed = run(daemon, "titan-killed")
        check(resumed[0]["loaded"] and resumed[0]["from"] in (6, 9),
              "load(-1) resumed from the newest durable save: %s" % resumed[0])
        check(resumed[-1]["final"] == whole[-1]["final"],
              "killed and resumed ends bitwise as never killed")
        last = run(daemon, "titan-whole", "--load-step", str(STEPS))
        check(last[0].get("hash") == whole[-1]["final"],
              "load(step=%d) gives the final weights and optimizer state" % STEPS)
        never = run(daemon, "titan-whole", "--load-step", "4")
        check("step-4" in never[0].get("refused", ""), "a step never saved is refused: %s"
              % never[0])
        print("torchtitan manager: resumed from step %d after a kill at step 9, bitwise"
              % resumed[0]["from"])
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
