"""LLaVA (images in the prompt) beside transformers, what a user runs a vision-language model
with when they have no serving engine: ``LlavaForConditionalGeneration.generate`` on a batch,
offline on the same machine; and what infer's prefix cache buys when one image is asked
about again.

    python benchmarks/peers/llava_vs_transformers.py [--prompts 16] [--tokens 32] [--runs 3]

The model: a random LLaVA with a CLIP ViT-B/16-shaped vision tower (768 wide, 12 layers,
224 px: 196 image tokens) and a ~110M Llama (768 wide, 12 layers), the projector between; each
prompt a different random image and the same question, greedy, ``--tokens`` tokens each
(EOS ignored).

- **transformers**: all prompts in one ``generate`` call (same length: no padding), float32.
- **infer**: ``LLM.generate`` of the same prompts, float32 (outputs compared token for token
  with transformers') and bfloat16.
- **the same image again**: four questions about one image one after another (a chat about a
  picture), each one token (the time to the first token), prefix caching on and off.

Medians of ``--runs`` (a warm-up run first).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.bench.offline import median_seconds
from infer.bench.report import machine_line, offline_machine

QUESTIONS = ["Describe the picture.", "What colours are in it?", "Is there a person?",
             "Where was it taken?"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    from infer import LLM, SamplingParams
    from infer.testing.bench_models import BERT_BASE_DIR
    from infer.testing.vision import build_llava, random_image

    folder = build_llava(
        BERT_BASE_DIR, name="llava-vitb16-llama110m",
        text_shape=dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                        num_key_value_heads=12, num_hidden_layers=12),
        vision_shape=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                          num_hidden_layers=12, image_size=224, patch_size=16),
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    per_image = model.config.image_seq_length
    images = [random_image(100 + i, (320, 240)) for i in range(a.prompts)]
    prompt = f"USER: <image>\n{QUESTIONS[0]} ASSISTANT:"
    ids = tok.encode(prompt.replace("<image>", "<image>" * per_image), add_special_tokens=False)

    def hf() -> list[list[int]]:
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        batch = torch.tensor([ids] * len(images))
        with torch.inference_mode():
            out = model.generate(input_ids=batch, pixel_values=pixels,
                                 attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=a.tokens, min_new_tokens=a.tokens)  # fmt: skip
        return out[:, len(ids) :].tolist()

    def timed(fn) -> tuple[float, object]:
        seconds, result = median_seconds(fn, a.runs)
        return a.prompts * a.tokens / seconds, result

    rate_hf, want = timed(hf)
    print(machine_line(offline_machine()))
    print(f"{a.prompts} prompts of {len(ids)} tokens ({per_image} image tokens each), "
          f"{a.tokens} tokens each; medians of {a.runs} runs")  # fmt: skip
    print(f"transformers float32, one batch: {rate_hf:.1f} tok/s")
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(folder), dtype=dtype, max_num_seqs=a.prompts, enable_prefix_caching=False)
        prompts = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images]

        def ours(llm=llm, prompts=prompts) -> list[list[int]]:
            return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]

        rate, got = timed(ours)
        pairs = list(zip(got, want, strict=True))  # type: ignore[arg-type]
        same = sum(g == w for g, w in pairs)
        # (random weights leave near-ties: where an output parts from transformers')
        parted = sorted(next(i for i, (x, y) in enumerate(zip(g, w, strict=True)) if x != y)
                        for g, w in pairs if g != w)  # fmt: skip
        print(f"infer {dtype}: {rate:.1f} tok/s ({rate / rate_hf:.2f}x); "
              f"{same}/{a.prompts} outputs token-identical to transformers'"
              + (f" (the others part at tokens {parted})" if parted else ""))  # fmt: skip
        llm.shutdown()

    one = SamplingParams(max_tokens=1, temperature=0)
    for caching in (False, True):
        llm = LLM(str(folder), dtype="float32", enable_prefix_caching=caching)
        times = []
        for run in range(a.runs + 1):
            image = random_image(200 + run, (320, 240))  # (a new picture each run)
            took = []
            for question in QUESTIONS:
                t = time.perf_counter()
                llm.generate({"prompt": f"USER: <image>\nAbout this picture: {question} "
                              "ASSISTANT:", "multi_modal_data": {"image": image}}, one)  # fmt: skip
                took.append(time.perf_counter() - t)
            if run:  # (the first run warms up)
                times.append(took)
        first = statistics.median(t[0] for t in times)
        later = statistics.median(x for t in times for x in t[1:])
        print(f"the same image again, prefix caching {'on' if caching else 'off'}: first "
              f"question {first * 1000:.0f} ms, the next ones {later * 1000:.0f} ms each")  # fmt: skip
        llm.shutdown()


if __name__ == "__main__":
    main()
