"""What sending one step to a tensor-parallel worker costs on the host, by transport.

Rank 0 sends each worker the step's SchedulerOutput before every step, and the worker's forward
cannot start before it has it. A real decode step's message is built (batch 1 and 32, prompts of
128 and 2048 tokens, 32 output tokens) and timed from rank 0's send to the worker having the
object, as a round trip: the worker answers with one byte over the same transport.

- socket: libkk's way (`TPExecutor.send`): pickled once, written to a socket pair, unpickled by
  the worker;
- gloo: `torch.distributed.broadcast_object_list` over a gloo group (the peer way, and libkk's
  before), the answer a one-element gloo broadcast;
- floor: the same round trip of an empty message over the socket pair.

    python benchmarks/step_messages.py [--repeats 300] [--out step_messages.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [(1, 128), (32, 128), (32, 2048)]  # (batch, prompt tokens)
OUTPUT_TOKENS = 32
STOP = pickle.dumps(None)


def decode_step(batch: int, prompt: int):
    """A decode step's SchedulerOutput as the scheduler builds it for `batch` greedy requests."""
    from libkk import SamplingParams
    from libkk.runtime.io import DECODE_STEP, ScheduledRequest, SchedulerOutput
    from libkk.sample.sampler import SamplingRow

    requests = []
    for i in range(batch):
        tokens = prompt + OUTPUT_TOKENS
        row = SamplingRow(
            params=SamplingParams(temperature=0.0, max_tokens=256, seed=i),
            seed=i,
            position=tokens,
            prompt_token_ids=list(range(prompt)),
            output_token_ids=list(range(OUTPUT_TOKENS)),
        )
        blocks = list(range(i * 200, i * 200 + tokens // 16 + 1))
        requests.append(ScheduledRequest(f"request-{i}", [7], tokens - 1, blocks, row))
    return SchedulerOutput(requests, kind=DECODE_STEP)


def _round_trips(send, answer, message, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        send(message)
        answer()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _summary(times: list[float]) -> dict:
    times = sorted(times)
    return {"us": statistics.median(times), "p10": times[len(times) // 10],
            "p90": times[9 * len(times) // 10]}  # fmt: skip


def _gloo_rank(rank: int, port: int, repeats: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ack = torch.zeros(1)
    results = {}
    for batch, prompt in CASES:
        message = decode_step(batch, prompt)
        if rank == 0:

            def send(m):
                dist.broadcast_object_list([m], src=0)

            def answer():
                dist.broadcast(ack, src=1)

            _round_trips(send, answer, message, 10)
            results[f"b{batch} p{prompt}"] = _summary(_round_trips(send, answer, message, repeats))
        else:
            for _ in range(10 + repeats):
                box = [None]
                dist.broadcast_object_list(box, src=0)
                dist.broadcast(ack, src=1)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def bench_gloo(repeats: int, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return results


def bench_socket(repeats: int) -> tuple[dict, dict]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the worker: receive, unpickle (an empty message: nothing), answer; None stops
        ours.close()
        conn = Connection(theirs.detach())
        while (data := conn.recv_bytes()) != STOP:
            if data:
                pickle.loads(data)
            conn.send_bytes(b"k")
        os._exit(0)
    theirs.close()
    conn = Connection(ours.detach())

    def send(message):
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    results = {}
    for batch, prompt in CASES:
        message = decode_step(batch, prompt)
        _round_trips(send, conn.recv_bytes, message, 10)
        results[f"b{batch} p{prompt}"] = _summary(
            _round_trips(send, conn.recv_bytes, message, repeats)
        )
        results[f"b{batch} p{prompt}"]["bytes"] = len(pickle.dumps(message, protocol=5))
    floor = _summary(_round_trips(conn.send_bytes, conn.recv_bytes, b"", repeats))
    conn.send_bytes(STOP)
    os.waitpid(pid, 0)
    return results, floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--port", type=int, default=29547)
    ap.add_argument("--out", default="step_messages.json")
    args = ap.parse_args()
    sockets, floor = bench_socket(args.repeats)
    gloo = bench_gloo(args.repeats, args.port)
    report = {"cpus": os.cpu_count(), "socket": sockets, "gloo": gloo, "floor": floor}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nstep message round trip (us, median [p10-p90]); empty-message floor "
          f"{floor['us']:.0f} [{floor['p10']:.0f}-{floor['p90']:.0f}]")  # fmt: skip
    print(f"{'case':<12}{'bytes':>8}{'socket':>20}{'gloo':>20}")
    for case, s in sockets.items():
        g = gloo[case]
        print(f"{case:<12}{s['bytes']:>8}{s['us']:>8.0f} [{s['p10']:.0f}-{s['p90']:.0f}]"
              f"{g['us']:>10.0f} [{g['p10']:.0f}-{g['p90']:.0f}]")  # fmt: skip


if __name__ == "__main__":
    main()
