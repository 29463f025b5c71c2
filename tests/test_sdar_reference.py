"""fluxlab's SDAR reference routines (fluxlab/models/sdar/reference.py, on fluxlab's own model) against the published
ones, token for token: JetAstra/SDAR generate.py's block_diffusion_generate and huggingface_bd3.py's, run on the
published modeling code (tests/sdar_oracle.py) with the same checkpoint, fp32 on CPU, the same seed."""
import json

import pytest
import torch

import sdar_oracle
from fluxlab.models.sdar.checkpoint import write_sdar_checkpoint
from fluxlab.models.sdar.loader import load_model
from fluxlab.models.sdar.reference import sdar_generate, transfer_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["tiny_sdar", "tiny_sdar_moe"])
def models(request, tmp_path_factory):
    folder = write_sdar_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    cfg = json.loads((folder / "config.json").read_text())
    ours, _ = load_model(folder, torch.float32, "cpu", progress=False)
    return ours, sdar_oracle.load_model(folder), cfg


PROMPTS = [[17, 250, 300, 12, 7], [901, 44, 2, 2, 310, 77, 120, 9], [5]]
# (block, steps, remasking, threshold, temperature, top_k, top_p)
GENERATE_CASES = [
    (4, 4, "low_confidence_dynamic", 0.85, 1.0, 0, 1.0),  # SDAR's defaults
    (4, 2, "low_confidence_dynamic", 0.3, 0.7, 0, 1.0),
    (8, 8, "low_confidence_static", 0.85, 1.0, 50, 1.0),
    (8, 4, "sequential", 0.85, 1.0, 0, 0.9),
]
BD3_CASES = [(4, 4, 0.9, 1.0, 0, 1.0), (8, 4, 0.5, 0.8, 20, 0.95), (4, 2, 1.0, 1.0, 0, 1.0)]


def _published_generate(published_model, prompt, cfg, seed, block, steps, remasking, threshold, temp, top_k, top_p):
    routines = sdar_oracle.load()
    torch.manual_seed(seed)
    x = routines.generate.block_diffusion_generate(
        published_model, {"input_ids": torch.tensor([prompt])}, mask_id=cfg["mask_token_id"], gen_length=24,
        block_length=block, denoising_steps=steps, temperature=temp, top_k=top_k, top_p=top_p,
        remasking_strategy=remasking, confidence_threshold=threshold, stopping_criteria_idx=[cfg["eos_token_id"]])
    return x[0].tolist()


@pytest.mark.parametrize("case", GENERATE_CASES, ids=lambda c: f"{c[2]}-b{c[0]}s{c[1]}")
def test_generate_py_routine_token_for_token(models, case):
    ours, published, cfg = models
    block, steps, remasking, threshold, temp, top_k, top_p = case
    for seed, prompt in enumerate(PROMPTS):
        theirs = _published_generate(published, prompt, cfg, seed, *case)
        mine = sdar_generate(ours, prompt, mask_id=cfg["mask_token_id"], max_new_tokens=24, block_length=block,
                             steps=steps, routine="generate", remasking=remasking, threshold=threshold,
                             temperature=temp, top_k=top_k, top_p=top_p, stop_ids=[cfg["eos_token_id"]],
                             generator=torch.Generator().manual_seed(seed))
        assert mine == theirs, (prompt, seed)


@pytest.mark.parametrize("case", BD3_CASES, ids=lambda c: f"t{c[2]}-b{c[0]}s{c[1]}")
def test_huggingface_bd3_routine_token_for_token(models, case):
    ours, published, cfg = models
    block, steps, threshold, temp, top_k, top_p = case
    routines = sdar_oracle.load()
    for seed, prompt in enumerate(PROMPTS):
        torch.manual_seed(seed)
        theirs = routines.bd3.block_diffusion_generate(
            published, None, {"input_ids": torch.tensor([prompt]), "attention_mask": None},
            mask_id=cfg["mask_token_id"], gen_length=24, block_length=block, denoising_steps=steps,
            temperature=temp, top_k=top_k, top_p=top_p, threshold=threshold,
            stopping_criteria_idx=[cfg["eos_token_id"]])[0].tolist()
        mine = sdar_generate(ours, prompt, mask_id=cfg["mask_token_id"], max_new_tokens=24, block_length=block,
                             steps=steps, routine="bd3", threshold=threshold, temperature=temp, top_k=top_k,
                             top_p=top_p, stop_ids=[cfg["eos_token_id"]], generator=torch.Generator().manual_seed(seed))
        assert mine == theirs, (prompt, seed)


def test_transfer_schedule_gives_remainder_to_first_steps():
    assert transfer_schedule(4, 4) == [1, 1, 1, 1]
    assert transfer_schedule(8, 3) == [3, 3, 2]


def test_routines_refuse_greedy():
    with pytest.raises(ValueError, match="temperature"):
        from fluxlab.models.sdar.reference import propose

        propose(torch.zeros(2, 5), "generate", 0.0, 0, 1.0, None)


@pytest.mark.parametrize("routine", ["generate", "bd3"])
def test_stops_after_the_block_holding_a_stop_id_as_published(models, routine):
    """A stop id is a token the run emits in its second decoded block: both stop after that block, the
    later blocks stay masks."""
    ours, published, cfg = models
    prompt, mask = PROMPTS[0], cfg["mask_token_id"]
    kw = dict(mask_id=mask, max_new_tokens=24, block_length=4, steps=4, routine=routine, threshold=0.9,
              temperature=1.0)
    free = sdar_generate(ours, prompt, stop_ids=[], generator=torch.Generator().manual_seed(3), **kw)
    stop = free[9]  # position 9: the block [8, 12), the second decoded one
    mine = sdar_generate(ours, prompt, stop_ids=[stop], generator=torch.Generator().manual_seed(3), **kw)
    routines = sdar_oracle.load()
    torch.manual_seed(3)
    if routine == "generate":
        theirs = routines.generate.block_diffusion_generate(
            published, {"input_ids": torch.tensor([prompt])}, mask_id=mask, gen_length=24, block_length=4,
            denoising_steps=4, temperature=1.0, confidence_threshold=0.9, stopping_criteria_idx=[stop])
    else:
        theirs = routines.bd3.block_diffusion_generate(
            published, None, {"input_ids": torch.tensor([prompt]), "attention_mask": None}, mask_id=mask,
            gen_length=24, block_length=4, denoising_steps=4, temperature=1.0, threshold=0.9,
            stopping_criteria_idx=[stop])
    assert mine == theirs[0].tolist()
    first = next(i for i in range(len(prompt), len(mine)) if mine[i] == stop)
    end = (first // 4 + 1) * 4
    assert all(t == mask for t in mine[end:]) and end < len(mine)
