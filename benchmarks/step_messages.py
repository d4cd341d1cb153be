"""What sending one step to a tensor-parallel worker costs on the host, by transport.

Rank 0 sends each worker the step's SchedulerOutput before every step, and the worker's forward
cannot start before it has it. Decode steps of running requests are built (batch 1 and 32,
prompts of 128 and 2048 tokens, 32 output tokens so far, one more per step) and timed from rank
0's send to the worker having the step, as a round trip: the worker answers with one byte over
the same transport.

- socket, deltas: libkk's way (`TPExecutor.send`): the step encoded against the previous one
  (`libkk.engine.step_codec`), pickled, written to a socket pair, unpickled and decoded back
  into a SchedulerOutput by the worker;
- socket, whole: the whole SchedulerOutput pickled over the same socket;
- gloo: `torch.distributed.broadcast_object_list` of the whole SchedulerOutput over a gloo group
  (the usual torch.distributed way, and libkk's before), the answer a one-element broadcast;
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


class DecodeSteps:
    """Decode steps of `batch` running greedy requests: each `next()` appends one output token
    to every request (and a block every 16 tokens) and returns the step's SchedulerOutput."""

    def __init__(self, batch: int, prompt: int) -> None:
        from libkk import SamplingParams

        self.requests = []
        for i in range(batch):
            params = SamplingParams(temperature=0.0, max_tokens=4096, seed=i)
            outputs = list(range(OUTPUT_TOKENS))
            blocks = list(range(i * 300, i * 300 + (prompt + OUTPUT_TOKENS) // 16 + 1))
            self.requests.append((f"request-{i}", params, list(range(prompt)), outputs, blocks))

    def next(self):
        from libkk.runtime.io import DECODE_STEP, ScheduledRequest, SchedulerOutput
        from libkk.sample.sampler import SamplingRow

        scheduled = []
        for rid, params, prompt, outputs, blocks in self.requests:
            outputs.append(len(outputs))
            tokens = len(prompt) + len(outputs)
            if tokens > 16 * len(blocks):
                blocks.append(blocks[-1] + 1)
            row = SamplingRow(params, 0, tokens, prompt, outputs)
            scheduled.append(ScheduledRequest(rid, [outputs[-1]], tokens - 1, [blocks], row))
        return SchedulerOutput(scheduled, kind=DECODE_STEP)


def _round_trips(send, answer, steps: DecodeSteps, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        step = steps.next()
        start = time.perf_counter()
        send(step)
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
        steps = DecodeSteps(batch, prompt)
        if rank == 0:

            def send(m):
                dist.broadcast_object_list([m], src=0)

            def answer():
                dist.broadcast(ack, src=1)

            _round_trips(send, answer, steps, 10)
            results[f"b{batch} p{prompt}"] = _summary(_round_trips(send, answer, steps, repeats))
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


def bench_socket(repeats: int) -> tuple[dict, dict, dict]:
    from libkk.engine.executor import message_frame, write_frame
    from libkk.engine.step_codec import StepDecoder, StepEncoder, StepMessage

    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the worker: receive, unpickle, decode deltas, answer; STOP ends it
        ours.close()
        conn = Connection(theirs.detach())
        decoder = StepDecoder()
        while (data := conn.recv_bytes()) != STOP:
            if data:  # (empty: the floor)
                message = pickle.loads(data)
                if isinstance(message, StepMessage):
                    decoder.decode(message)
            conn.send_bytes(b"k")
        os._exit(0)
    theirs.close()
    conn = Connection(os.dup(ours.fileno()))  # to read the answers; `ours` writes

    def send(message):
        write_frame(ours, message_frame(message))

    deltas, whole = {}, {}
    for batch, prompt in CASES:
        case = f"b{batch} p{prompt}"
        steps = DecodeSteps(batch, prompt)
        _round_trips(send, conn.recv_bytes, steps, 10)
        whole[case] = _summary(_round_trips(send, conn.recv_bytes, steps, repeats))
        whole[case]["bytes"] = len(pickle.dumps(steps.next(), protocol=pickle.HIGHEST_PROTOCOL))
        encoder = StepEncoder()

        def send_delta(step, encoder=encoder):
            send(encoder.encode(step))

        _round_trips(send_delta, conn.recv_bytes, steps, 10)
        deltas[case] = _summary(_round_trips(send_delta, conn.recv_bytes, steps, repeats))
        message = encoder.encode(steps.next())
        deltas[case]["bytes"] = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    floor = _summary(_round_trips(lambda _: conn.send_bytes(b""), conn.recv_bytes,
                                  DecodeSteps(1, 1), repeats))  # fmt: skip
    conn.send_bytes(STOP)
    os.waitpid(pid, 0)
    ours.close()
    return deltas, whole, floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--port", type=int, default=29547)
    ap.add_argument("--out", default="step_messages.json")
    args = ap.parse_args()
    deltas, whole, floor = bench_socket(args.repeats)
    gloo = bench_gloo(args.repeats, args.port)
    report = {"cpus": os.cpu_count(), "socket_deltas": deltas, "socket_whole": whole,
              "gloo": gloo, "floor": floor}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nstep message round trip, µs: median [p10-p90]; empty-message floor "
          f"{floor['us']:.0f} [{floor['p10']:.0f}-{floor['p90']:.0f}]")  # fmt: skip
    print(f"{'case':<12}{'socket, deltas':>26}{'socket, whole':>28}{'gloo, whole':>20}")
    for case, d in deltas.items():
        w, g = whole[case], gloo[case]
        print(f"{case:<12}{d['bytes']:>7} B {d['us']:>6.0f} [{d['p10']:.0f}-{d['p90']:.0f}]"
              f"{w['bytes']:>9} B {w['us']:>6.0f} [{w['p10']:.0f}-{w['p90']:.0f}]"
              f"{g['us']:>9.0f} [{g['p10']:.0f}-{g['p90']:.0f}]")  # fmt: skip


if __name__ == "__main__":
    main()
