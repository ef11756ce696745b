"""Weights broadcast: a trainer publishes its model's state_dict after every step, three
inference processes load each version as it comes.

    pip install ./python torch        # torch optional: without it the model is numpy arrays
    python examples/python/weights_broadcast.py [--steps 5]

The trainer (this process) starts a local cluster, starts three inference processes, waits until they subscribed, then trains and publishes with `put_many`: each
version is one atomic set, so an inference process never loads layers of two different steps.
A slow reader may skip versions (it always gets the newest); each prints what it received,
and the run checks that every reader ended on the trainer's last weights.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys

import numpy as np

import tensor_broker as tb

PREFIX = "demo/model"
READERS = 3
# Longest an inference process waits for the next version.
NEXT_TIMEOUT_S = 60.0

try:
    import torch
except ImportError:  # the numpy model below stands in
    torch = None


def checksum(state: dict) -> str:
    """A short digest of a state_dict's bytes, the same for numpy and torch."""
    h = hashlib.sha256()
    for key in sorted(state):
        v = state[key]
        a = v.detach().cpu().numpy() if torch is not None and isinstance(v, torch.Tensor) else v
        h.update(key.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:12]


def make_model():
    if torch is not None:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    rng = np.random.default_rng(0)
    return {"0.weight": rng.standard_normal((32, 16)).astype(np.float32),
            "0.bias": np.zeros(32, np.float32),
            "2.weight": rng.standard_normal((4, 32)).astype(np.float32),
            "2.bias": np.zeros(4, np.float32)}


def train_step(model, step: int) -> dict:
    """One SGD step on random data; returns the state_dict to publish."""
    if torch is not None:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 16), torch.randn(64, 4)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return model.state_dict()
    for k in model:  # the numpy stand-in: a deterministic nudge
        model[k] = model[k] - np.float32(0.01 * step)
    return model


def inference(index: int, ticket: str, secret_file: str, steps: int) -> None:
    """An inference process: subscribe, say ready, load every version until the last."""
    model = make_model()
    with tb.connect(ticket, secret_file=secret_file) as client, client.subscribe(PREFIX) as sub:
        print("ready", flush=True)
        received = []
        for _ in range(steps):
            update = sub.next(timeout=NEXT_TIMEOUT_S)
            if torch is not None:
                state = update.tensors()
                model.load_state_dict(state)  # copies into the model's own parameters
            else:
                state = {k: np.array(v) for k, v in update.arrays().items()}
                model.update(state)
            received.append(update.version)
            print(f"inference {index}: v{update.version} ({update.skipped} skipped) "
                  f"{len(state)} tensors, checksum {checksum(state)}", flush=True)
            if update.version >= steps:
                break
        print(f"inference {index}: done, loaded {received}", flush=True)


def trainer(steps: int) -> int:
    with tb.LocalCluster() as cluster, cluster.connect() as client:
        ticket, secret = cluster.ticket, cluster.secret_file
        readers = [
            subprocess.Popen([sys.executable, __file__, "--infer", str(i), "--ticket", ticket,
                              "--secret-file", secret, "--steps", str(steps)],
                             stdout=subprocess.PIPE, text=True)
            for i in range(READERS)
        ]
        try:
            for r in readers:
                assert r.stdout is not None
                if r.stdout.readline().strip() != "ready":
                    raise SystemExit("an inference process did not start")
            model = make_model()
            sums = {}
            for step in range(1, steps + 1):
                state = train_step(model, step)
                version = client.put_many(PREFIX, state)
                sums[version] = checksum(state)
                print(f"trainer: step {step} published as v{version}, checksum {sums[version]}",
                      flush=True)
            ok = True
            for r in readers:
                out, _ = r.communicate(timeout=NEXT_TIMEOUT_S * 2)
                print(out, end="")
                last = [line for line in out.splitlines() if "checksum" in line][-1]
                ok &= last.endswith(sums[max(sums)]) and r.returncode == 0
            print("every reader ended on the trainer's last weights" if ok else "MISMATCH")
            return 0 if ok else 1
        finally:
            for r in readers:
                if r.poll() is None:
                    r.kill()
                    r.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--infer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ticket", help=argparse.SUPPRESS)
    p.add_argument("--secret-file", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.infer is not None:
        inference(a.infer, a.ticket, a.secret_file, a.steps)
        return 0
    return trainer(a.steps)


if __name__ == "__main__":
    sys.exit(main())
