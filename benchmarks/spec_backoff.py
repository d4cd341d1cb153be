"""Speculation against plain decoding on the CPU with the default model and its shipped DFlash
drafter: decode tok/s of plain decoding, of DFlash with the draft backoff (the default), with the
backoff and adaptive verification, and drafting every step, on a plain prompt and a
chat-formatted one.

The sessions run interleaved, repeat after repeat (greedy, EOS ignored, decode time from
each request's timeline, prefill excluded); the table gives each case's median, its spread and the
mean acceptance length. Writes JSON too.

    python benchmarks/spec_backoff.py [--tokens 64] [--repeats 5] [--threads 1] [--drafter DIR]
                                      [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

CASES = {
    "plain": None,
    "dflash": {"method": "dflash"},
    "dflash, adaptive": {"method": "dflash", "adaptive_verification": True},
    "dflash, no backoff": {"method": "dflash", "draft_backoff": False},
}
PLAIN_PROMPT = "def fib(n):"
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def main() -> None:
    from libkk import SamplingParams, Session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="num_threads (default: libkk's)")
    ap.add_argument("--drafter", default=None, help="a DFlash drafter folder (default: shipped)")
    ap.add_argument("--out", default="spec_backoff.json")
    args = ap.parse_args()

    params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)
    sessions = {
        name: Session(
            device="cpu",
            max_model_len=1024,
            progress=False,
            num_threads=args.threads,
            **({"speculative": {**spec, "draft_model": args.drafter}} if spec else {}),
        )
        for name, spec in CASES.items()
    }
    chat_prompt = sessions["plain"].tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    prompts = {"plain prompt": PLAIN_PROMPT, "chat prompt": chat_prompt}
    rates: dict[tuple[str, str], list[float]] = {}
    accept: dict[tuple[str, str], float] = {}
    for prompt_name, prompt in prompts.items():
        for s in sessions.values():
            s.generate(prompt, SamplingParams(max_tokens=4))  # warm up
        for _ in range(args.repeats):
            for name, s in sessions.items():
                before = s.stats()
                out = s.generate(prompt, params)
                after = s.stats()
                rates.setdefault((name, prompt_name), []).append(
                    args.tokens / out.timeline.decode_time
                )
                steps = after.get("spec_num_verify_steps", 0) - before.get(
                    "spec_num_verify_steps", 0
                )
                accepted = after.get("spec_num_accepted_tokens", 0) - before.get(
                    "spec_num_accepted_tokens", 0
                )
                accept[name, prompt_name] = (steps + accepted) / steps if steps else 0.0
    for s in sessions.values():
        s.close()

    rows = []
    print(f"{'case':<22}{'prompt':<15}{'tok/s':>8}{'spread':>16}{'vs plain':>10}{'accept':>8}")
    for (name, prompt_name), values in rates.items():
        median = statistics.median(values)
        plain = statistics.median(rates["plain", prompt_name])
        row = {
            "case": name,
            "prompt": prompt_name,
            "tok_s": median,
            "spread": [min(values), max(values)],
            "vs_plain": median / plain,
            "acceptance_length": accept[name, prompt_name],
        }
        rows.append(row)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(
            f"{name:<22}{prompt_name:<15}{median:>8.1f}{spread:>16}{median / plain:>10.2f}"
            f"{row['acceptance_length']:>8.2f}"
        )
    with open(args.out, "w") as f:
        json.dump({"tokens": args.tokens, "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
