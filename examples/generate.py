"""Generate text in-process with libkk: one prompt streamed, then a batch and a chat turn.

python examples/generate.py [MODEL]       # MODEL: an HF folder or .gguf; default: SmolLM2-135M
"""

from __future__ import annotations

import sys

import libkk


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    greedy = libkk.SamplingParams(max_tokens=32, temperature=0.0)
    with libkk.Session(model, max_model_len=2048) as session:
        print("stream: ", end="")
        for delta in session.stream("The capital of France is", greedy):
            print(delta.delta_text, end="", flush=True)
        print()

        prompts = ["Water boils at", "The largest planet is"]
        seeded = libkk.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=42)
        for out in session.generate(prompts, seeded):
            t = out.timeline
            print(
                f"{out.prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, "
                f"first token after {t.time_to_first_token * 1e3:.0f} ms)"
            )

        reply = session.chat([{"role": "user", "content": "Name three primary colours."}], greedy)
        print("chat:", reply.text)


if __name__ == "__main__":
    main()
