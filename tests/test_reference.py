"""The plain reference generate (DESIGN §5) on the tiny checkpoint."""
import pytest
import torch

from fluxlab.models.llada2.special_ids import special_token_ids
from fluxlab.models.llada2.reference import reference_generate, sample_tokens, transfer_schedule

CHAT_PROMPTS = ["What is the capital of France?", "Alice has 5 apples and buys 7 more. How many apples?",
                "Write a short poem about the ocean.", "Hello!", "Summarize the story in two sentences.",
                "12 + 30 = ?"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt), trust_remote_code=False)
    mask_id, eos_id, _ = special_token_ids(tiny_ckpt)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=False) for p in CHAT_PROMPTS]
    prompts = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    return tiny_model[0], prompts, mask_id, eos_id


@pytest.fixture(scope="module")
def runs(setup):
    model, prompts, mask_id, eos_id = setup
    return [reference_generate(model, p, mask_id=mask_id, eos_id=eos_id, max_new_tokens=256, threshold=0.9)
            for p in prompts]


def test_transfer_schedule_spreads_remainder_over_first_steps():
    assert transfer_schedule(32, 32) == [1] * 32
    assert transfer_schedule(32, 5) == [7, 7, 6, 6, 6]
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert sum(transfer_schedule(64, 7)) == 64


def test_greedy_confidence_is_full_vocab_softmax_probability():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    tokens, conf = sample_tokens(logits)
    assert tokens.tolist() == [1, 2]
    torch.testing.assert_close(conf, logits.softmax(-1).max(-1).values)


def test_at_least_k_accepted_every_step_and_several_at_threshold(setup, runs):
    _, prompts, _, _ = setup
    block = 32
    k = transfer_schedule(block, block)
    multi = False
    for prompt, out in zip(prompts, runs):
        for b, steps in enumerate(out.accepted_per_step):
            remaining = block - (len(prompt) % block if b == 0 else 0)
            for s, accepted in enumerate(steps):
                assert accepted >= min(k[s], remaining)
                multi |= accepted > 1
                remaining -= accepted
            assert remaining == 0  # every block ends fully decoded
    assert multi, "threshold 0.9 never accepted more than one token in a step"
    tpf = sum(len(o.token_ids) for o in runs) / sum(o.forwards for o in runs)
    assert tpf > 2.0


def test_fewer_steps_accept_at_least_the_scheduled_k(setup):
    model, prompts, mask_id, eos_id = setup
    k = transfer_schedule(32, 8)  # 4 per step
    exactly_k = False
    for prompt in prompts[:3]:
        out = reference_generate(model, prompt, mask_id=mask_id, eos_id=eos_id, max_new_tokens=96, steps=8,
                                 threshold=0.9, ignore_eos=True)
        for b, steps in enumerate(out.accepted_per_step):
            assert len(steps) <= 8
            remaining = 32 - (len(prompt) % 32 if b == 0 else 0)
            for s, accepted in enumerate(steps):
                assert accepted >= min(k[s], remaining)
                exactly_k |= accepted == k[s] < remaining
                remaining -= accepted
            assert remaining == 0
    assert exactly_k  # some steps had fewer than k confident positions and took the top k


def test_low_threshold_accepts_more_per_forward_than_high(setup):
    model, prompts, mask_id, eos_id = setup
    lo = reference_generate(model, prompts[0], mask_id=mask_id, eos_id=eos_id, max_new_tokens=40, threshold=0.5,
                            ignore_eos=True)
    hi = reference_generate(model, prompts[0], mask_id=mask_id, eos_id=eos_id, max_new_tokens=40, threshold=1.0,
                            ignore_eos=True)
    # steps = min(32, 40) = 32: one token per step at threshold 1.0, so one forward per masked position
    decoded = len(hi.canvas) - len(prompts[0])
    assert hi.forwards == decoded and lo.forwards < hi.forwards


def test_prompt_tokens_are_never_changed(setup, runs):
    _, prompts, _, _ = setup
    for prompt, out in zip(prompts, runs):
        assert out.canvas[:len(prompt)] == prompt


def test_outputs_vary_with_prompt_and_are_not_constant(runs):
    outs = [tuple(o.token_ids[:32]) for o in runs]
    assert len(set(outs)) == len(outs)
    for o in runs:
        assert len(set(o.token_ids)) > 3


def test_stops_after_the_block_holding_the_first_eos(setup, runs):
    model, prompts, mask_id, eos_id = setup
    stopped = [(p, o) for p, o in zip(prompts, runs) if o.finish_reason == "stop"]
    assert stopped, "the tiny model should end some answers with EOS"
    assert any(o.finish_reason == "length" for o in runs)
    for i, (prompt, out) in enumerate(stopped):
        assert len(out.token_ids) >= 8  # EOS, but not immediately
        assert eos_id not in out.token_ids
        eos_pos = len(prompt) + len(out.token_ids)
        assert out.canvas[eos_pos] == eos_id
        eos_block_end = (eos_pos // 32 + 1) * 32
        assert all(t == mask_id for t in out.canvas[eos_block_end:])  # later blocks never decoded
        assert mask_id not in out.canvas[:eos_block_end]
        if i:
            continue
        # Stopping changes no returned token: ignoring EOS gives the same prefix, then the EOS.
        longer = reference_generate(model, prompt, mask_id=mask_id, eos_id=eos_id, max_new_tokens=256,
                                    threshold=0.9, ignore_eos=True)
        assert longer.token_ids[:len(out.token_ids) + 1] == out.token_ids + [eos_id]
        assert longer.forwards > out.forwards


def test_output_is_cut_at_max_new_tokens(setup):
    model, prompts, mask_id, eos_id = setup
    out = reference_generate(model, prompts[1], mask_id=mask_id, eos_id=eos_id, max_new_tokens=10, ignore_eos=True)
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    # the last block is decoded whole: positions past max_new_tokens took part too
    end = -(-(len(prompts[1]) + 10) // 32) * 32
    assert mask_id not in out.canvas[:end]


def test_forwards_are_counted(setup):
    model, prompts, mask_id, eos_id = setup
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        for decoder in ["threshold", "joint_threshold"]:
            calls.clear()
            out = reference_generate(model, prompts[2], mask_id=mask_id, eos_id=eos_id, decoder=decoder,
                                     max_new_tokens=64, threshold=0.9)
            assert out.forwards == len(calls) > 0
            if decoder == "threshold":
                assert out.forwards == sum(len(s) for s in out.accepted_per_step)
    finally:
        handle.remove()


def test_joint_threshold_edits_never_touch_prompt(setup):
    model, prompts, mask_id, eos_id = setup
    total_edits = 0
    for prompt in prompts[:4]:
        out = reference_generate(model, prompt, mask_id=mask_id, eos_id=eos_id, decoder="joint_threshold",
                                 max_new_tokens=96, threshold=0.5, editing_threshold=0.0, max_post_steps=4)
        assert out.canvas[:len(prompt)] == prompt
        total_edits += out.edits
        for steps in out.accepted_per_step:
            assert all(a >= 0 for a in steps)
    assert total_edits > 0, "editing_threshold 0.0 should edit something on the tiny model"


def test_joint_threshold_fills_at_least_one_mask_per_forward_until_done(setup):
    model, prompts, mask_id, eos_id = setup
    out = reference_generate(model, prompts[0], mask_id=mask_id, eos_id=eos_id, decoder="joint_threshold",
                             max_new_tokens=64, threshold=0.99, editing_threshold=0.9, max_post_steps=2,
                             ignore_eos=True)
    for b, steps in enumerate(out.accepted_per_step):
        remaining = 32 - (len(prompts[0]) % 32 if b == 0 else 0)
        filling = [a for a in steps if a > 0]
        assert sum(filling) == remaining
        assert steps[:len(filling)] == filling  # while masks remain, every forward fills >= 1
    assert len(out.token_ids) == 64 and mask_id not in out.token_ids


def test_joint_threshold_post_steps_are_bounded(setup):
    model, prompts, mask_id, eos_id = setup
    out = reference_generate(model, prompts[3], mask_id=mask_id, eos_id=eos_id, decoder="joint_threshold",
                             max_new_tokens=32, threshold=0.5, editing_threshold=0.0, max_post_steps=3,
                             ignore_eos=True)
    blocks = len(out.accepted_per_step)
    # per block: forwards with masks + at most max_post_steps forwards without masks
    fill_forwards = sum(1 for steps in out.accepted_per_step for a in steps if a > 0)
    assert out.forwards <= fill_forwards + blocks * 3


def test_sampling_is_seeded(setup):
    model, prompts, mask_id, eos_id = setup
    kw = dict(mask_id=mask_id, eos_id=eos_id, max_new_tokens=32, temperature=1.0, top_k=50, top_p=0.9,
              ignore_eos=True)
    a = reference_generate(model, prompts[0], seed=1, **kw)
    b = reference_generate(model, prompts[0], seed=1, **kw)
    c = reference_generate(model, prompts[0], seed=2, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_block_aligned_prompt_starts_with_an_all_mask_block(setup):
    model, prompts, mask_id, eos_id = setup
    prompt = (prompts[0] * 10)[:64]
    out = reference_generate(model, prompt, mask_id=mask_id, eos_id=eos_id, max_new_tokens=32, ignore_eos=True)
    assert out.canvas[:64] == prompt and len(out.canvas) == 96
    assert sum(out.accepted_per_step[0]) == 32 and len(out.accepted_per_step) == 1


def test_hierarchy_rule_one_per_masked_run_plus_confident_plus_best():
    from fluxlab.models.llada2.reference import _hierarchy_choice

    masked = [True, True, False, True, True, True, False, True]
    conf = [0.2, 0.4, 0.99, 0.35, 0.35, 0.1, 0.5, 0.95]
    # run [0,1]: best 0.4 > 0.3; run [3,4,5]: first best (3) 0.35 > 0.3; run [7]: 0.95 > 0.9 anyway;
    # position 2 is not masked, so its 0.99 does not count
    assert _hierarchy_choice(masked, conf, 0.9, 0.3) == [False, True, False, True, False, False, False, True]
    # nothing above either threshold: still the single most confident masked position
    assert _hierarchy_choice(masked, [0.1] * 8, 0.9, 0.3) == [True] + [False] * 7


def test_hierarchy_decodes_every_block_fully(setup):
    model, prompts, mask_id, eos_id = setup
    out = reference_generate(model, prompts[1], mask_id=mask_id, eos_id=eos_id, decoder="hierarchy",
                             max_new_tokens=64, threshold=0.9, low_threshold=0.3, ignore_eos=True)
    for b, steps in enumerate(out.accepted_per_step):
        assert all(a >= 1 for a in steps)
        assert sum(steps) == 32 - (len(prompts[1]) % 32 if b == 0 else 0)
    assert out.forwards == sum(len(s) for s in out.accepted_per_step)
    assert out.forwards < 64 and mask_id not in out.token_ids


@pytest.mark.parametrize("decoder", ["threshold", "joint_threshold", "hierarchy"])
def test_literal_mask_in_prompt_is_prompt_text(setup, decoder):
    model, prompts, mask_id, eos_id = setup
    prompt = prompts[0][:5] + [mask_id] + prompts[0][5:]
    out = reference_generate(model, prompt, mask_id=mask_id, eos_id=eos_id, decoder=decoder, max_new_tokens=20,
                             editing_threshold=0.0, max_post_steps=2, ignore_eos=True)
    assert out.canvas[:len(prompt)] == prompt
    assert len(out.token_ids) == 20 and mask_id not in out.token_ids
