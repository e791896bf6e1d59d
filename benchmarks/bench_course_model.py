"""The course model (SmolLM2-135M-Instruct, float32) in vllmini against transformers' `generate`: tokens/s.

The same chat prompts (the model's chat template), greedy, exactly --new-tokens new tokens each (vllmini
with ignore_eos, transformers with min_new_tokens), at each batch size: one batch of B prompts run to the
end, timed from the call to the last token (prefill included), best of --repeats rounds after a warm-up
round; the two alternate within a round (a machine shared with other work slows both alike).
transformers runs a batch left-padded with an attention mask, its usual way; vllmini packs the prompts
without padding and decodes all B sequences in one forward per step over the paged KV cache.

    python benchmarks/bench_course_model.py                       # CPU, batch 1 and 8
    python benchmarks/bench_course_model.py --device cuda --batch-sizes 1 8 64

The model is fetched the first time (vllmini.models). Targets (issue 22): on 2 CPU cores, vllmini at
batch 1 no slower per token than generate, at batch 8 at least 3x generate's tokens/s.

Recorded in benchmarks/RESULTS.md ("The course model against generate"): on 2 idle CPU cores, --threads 2
--repeats 6, batch 1 1.00x and batch 8 0.98x generate (4.1x generate's batch-1 rate); on an H200 7.3x, 5.7x
and 3.7x at batch 1, 8 and 64. On equal-length requests on a CPU both run the same matrix products (memory
bound on the weights), so batched generate is as fast per step: the paged engine's gains there are memory
(more sequences fit) and retiring finished requests, which this fixed-length run does not exercise.
"""

from __future__ import annotations

import argparse
import time

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping well.",
    "What is the largest planet in the solar system?",
    "Explain what a CPU does in one sentence.",
    "Why is the sky blue?",
]


def best_times(repeats: int, runs: list) -> list[float]:
    """The shortest wall time of each of `runs` over `repeats` rounds, after one warm-up round. The runs
    alternate within a round, so a busy spell on a shared machine hits both sides alike."""
    best = [float("inf")] * len(runs)
    for r in range(repeats + 1):
        for i, run in enumerate(runs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if r > 0:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllmini import LLMEngine, SamplingParams, models
    from vllmini.model import LlamaModel

    path = models.fetch("SmolLM2-135M-Instruct")
    dev = torch.device(args.device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:  # some transformers versions read none from the converted folder
        tok.pad_token = tok.eos_token
    model = LlamaModel.from_pretrained(path, dtype=torch.float32, device=dev)
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    print(
        f"SmolLM2-135M-Instruct float32 on {args.device} ({torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, {n} new tokens per prompt, best of {args.repeats}"
    )
    print(f"{'batch':>5} {'generate tok/s':>15} {'vllmini tok/s':>14} {'ratio':>6}  ms/token (gen / vllmini)")
    for b in args.batch_sizes:
        chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(b)]
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        enc = tok(texts, return_tensors="pt", padding=True).to(dev)

        @torch.inference_mode()
        def run_hf(enc=enc):
            out = hf.generate(
                **enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id
            )
            assert out.shape[1] - enc["input_ids"].shape[1] == n

        longest = max(len(ids) for ids in tok(texts)["input_ids"]) + n
        engine = LLMEngine(model, block_size=16, num_blocks=b * (longest // 16 + 2), max_model_len=longest)

        def run_vllmini(engine=engine, texts=texts):
            outs = engine.generate(texts, params, use_tqdm=False)
            assert all(len(o.output_token_ids) == n for o in outs)

        t_hf, t_v = best_times(args.repeats, [run_hf, run_vllmini])
        rate_hf, rate_v = b * n / t_hf, b * n / t_v
        print(
            f"{b:>5} {rate_hf:>15.1f} {rate_v:>14.1f} {rate_v / rate_hf:>5.2f}x  "
            f"{1000 * t_hf / n:.1f} / {1000 * t_v / n:.1f}"
        )


if __name__ == "__main__":
    main()
