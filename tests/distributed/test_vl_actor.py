"""The actor on vision-language batches: RolloutBatch rows with `pixel_values` / `image_grid_thw`
(the prompt's images, shared by a group's responses) through the micro-batch packing, the
vision tower and the DAPO update, at TP1, EP2 (two DP ranks split the groups) and TP2 (sequence
parallel). Log-probs against HF transformers, updates against TP1."""
import pytest
import torch

from dapo_megatron.assets.models import TINY_VL_MOE
from dapo_megatron.batch import RolloutBatch
from dapo_megatron.train.parallel import run_workers

import actor_jobs

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.background]

HF_TOL = 1e-4
LAYOUT_TOL = 1e-5
MAX_TOKENS = 700  # two or three sequences per micro-batch: images of several rows in one
IMAGE = TINY_VL_MOE["image_token_id"]
START, END = TINY_VL_MOE["vision_start_token_id"], TINY_VL_MOE["vision_end_token_id"]
VISION = TINY_VL_MOE["vision_config"]
PATCH_DIM = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
# Per group: (text tokens before each image, its grid), then text after; 2 responses per group.
GROUPS = [[(90, (1, 8, 12))], [(40, (1, 6, 4)), (120, (1, 4, 8))], [], [(10, (1, 10, 6))]]
LAYOUTS = {"tp1": (dict(), 1), "ep2": (dict(ep=2), 2), "tp2": (dict(tp=2, etp=2), 2)}


def make_vl_batch(seed: int = 0) -> RolloutBatch:
    """Groups of 2 responses to prompts of 150-260 tokens with 0-2 images each (random pixels)."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, IMAGE, (n,), generator=g).tolist()  # noqa: E731
    samples = []
    for gid, images in enumerate(GROUPS):
        ids, grids = [], []
        for n_text, grid in images:
            ids += text(n_text) + [START] + [IMAGE] * (grid[1] * grid[2] // VISION["spatial_merge_size"] ** 2) + [END]
            grids.append(grid)
        ids += text(150 - len(ids) % 100)
        grids = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        pixels = torch.randn(int(grids.prod(-1).sum()), PATCH_DIM, generator=g)
        for _ in range(2):
            samples.append(dict(prompts=ids, responses=text(int(torch.randint(5, 30, (1,), generator=g))),
                                group=gid, prompt_index=gid, pixel_values=pixels, image_grid_thw=grids))
    batch = RolloutBatch.from_samples(samples)
    batch.advantages = torch.randn(len(samples), generator=g)
    return batch


def vl_actor_job(hf_dir: str, parallel: dict, batch: RolloutBatch) -> bytes:
    """Log-probs of `batch`, then one update: its metrics, new log-probs and exported weights."""
    from dapo_megatron.config.schema import ParallelConfig
    from dapo_megatron.train.parallel import init_parallel
    init_parallel(ParallelConfig(**parallel))
    from dapo_megatron.train.actor import Actor
    actor = Actor(actor_jobs.actor_config(parallel, max_tokens_per_microbatch=MAX_TOKENS), hf_dir, n=2)
    logprobs = actor_jobs.everywhere(actor.compute_logprobs(batch))["logprobs"]
    return actor_jobs.pack({"logprobs": logprobs, "update": actor_jobs.run_updates(hf_dir, parallel, batch, {
        "max_tokens_per_microbatch": MAX_TOKENS})})


@pytest.fixture(scope="module")
def vl_setup(tmp_path_factory):
    from dapo_megatron.assets.models import build_tiny_vl_model
    hf_dir = build_tiny_vl_model(str(tmp_path_factory.mktemp("qwen3_vl_moe")), seed=0)
    return hf_dir, make_vl_batch()


@pytest.fixture(scope="module")
def results(vl_setup):
    cache = {}

    def get(layout):
        if layout not in cache:
            parallel, world = LAYOUTS[layout]
            hf_dir, batch = vl_setup
            blobs = run_workers(vl_actor_job, world, hf_dir, {"tp": 1, "pp": 1, "ep": 1, "etp": 1, **parallel},
                                batch, timeout_s=600)
            cache[layout] = [actor_jobs.unpack(b) for b in blobs]
        return cache[layout]
    return get


def hf_logprobs(hf_dir: str, batch: RolloutBatch) -> torch.Tensor:
    """[B, T] log-probs of the responses under HF transformers, one sample (and its images) at a time."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
            ids = torch.cat([p, r])[None]
            kw = dict(pixel_values=batch.pixel_values[i], image_grid_thw=batch.image_grid_thw[i]) \
                if len(batch.image_grid_thw[i]) else {}
            logits = model(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **kw).logits
            logits = logits[0, len(p) - 1: len(p) - 1 + len(r)]  # [R, V]
            out[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
    return out


def test_the_batch_has_what_the_test_claims(vl_setup):
    _, batch = vl_setup
    counts = [int((p == IMAGE).sum()) for p in batch.prompts]
    assert min(counts) == 0 and max(len(g) for g in batch.image_grid_thw) == 2  # text rows and 2-image rows
    assert min(len(p) for p in batch.prompts) >= 150
    from dapo_megatron.train import microbatch as mb
    bins = mb.token_bins(batch.sequence_lengths, MAX_TOKENS)
    assert len(bins) > 2 and max(len(b) for b in bins) > 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vl_logprobs_match_hf(layout, vl_setup, results):
    hf_dir, batch = vl_setup
    want = hf_logprobs(hf_dir, batch)
    got = results(layout)[0]["logprobs"]
    diff = ((got - want).abs() * batch.loss_mask).max().item()
    print(f"qwen3_vl_moe actor {layout}: max |log-prob - HF| = {diff:.2e}")
    assert diff <= HF_TOL


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "tp1"])
def test_vl_update_matches_tp1(layout, results):
    want = results("tp1")[0]["update"]
    for rank, res in enumerate(results(layout)):
        got = res["update"]
        assert (got["logprobs"] - want["logprobs"]).abs().max().item() <= LAYOUT_TOL, f"{layout} rank {rank}"
        actor_jobs.assert_same_weights(got, want, LAYOUT_TOL, f"{layout} rank {rank}")


def test_vl_update_trains_the_vision_tower(vl_setup, results):
    from safetensors.torch import load_file
    import glob
    hf_dir, _ = vl_setup
    before = {k: v for f in glob.glob(f"{hf_dir}/*.safetensors") for k, v in load_file(f).items()}
    after = results("tp1")[0]["update"]["weights"]
    tower = [n for n in after if ".visual." in n or n.startswith("visual.")]
    assert tower, f"no vision tower weights exported: {sorted(after)[:5]}"
    moved = [n for n in tower if not torch.equal(after[n], before[n])]
    assert len(moved) > len(tower) // 2, f"only {len(moved)} of {len(tower)} tower tensors changed"
    m = results("tp1")[0]["update"]["metrics"][0]
    assert m["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["actor/pg_loss"]))
