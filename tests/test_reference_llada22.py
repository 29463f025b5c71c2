"""The plain LLaDA2.2 reference generate (levenshtein_joint) on tiny_llada22 and on a scripted model."""
import pytest
import torch
from torch import nn

from fluxlab.models.llada2.reference import reference_generate
from fluxlab.models.llada2.reference_llada22 import reference_generate_llada22

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["What is the capital of France?", "Hello!", "12 + 30 = ?"]


@pytest.fixture(scope="module")
def tiny22(tmp_path_factory):
    from transformers import AutoTokenizer

    from fluxlab.checkpoint import ensure_tiny_checkpoint
    from fluxlab.models.llada2.loader import load_model
    from fluxlab.models.llada2.special_ids import special_ids

    path = ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache22"), preset="tiny_llada22")
    model, _ = load_model(path, torch.float32, "cpu", progress=False)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for p in PROMPTS]
    return model, special_ids(path), prompts


def _generate(model, ids, prompt, **kw):
    return reference_generate(model, prompt, mask_id=ids.mask_id, eos_id=ids.eos_id, stop_ids=ids.stop_ids,
                              decoder="levenshtein_joint", delete_id=ids.delete_id, split_id=ids.split_id,
                              block_length=32, **kw)


def test_tiny_llada22_has_edit_tokens_and_two_stop_ids(tiny22):
    _, ids, _ = tiny22
    assert len(ids.stop_ids) == 2 and ids.stop_ids[0] == ids.eos_id
    assert len({ids.mask_id, ids.delete_id, ids.split_id, *ids.stop_ids}) == 5


@pytest.mark.parametrize("knobs", [dict(threshold=0.5, editing_threshold=0.0, max_post_steps=16),
                                   dict(threshold=0.7, editing_threshold=0.5, max_post_steps=0, steps=8),
                                   dict(threshold=0.5, editing_threshold=0.0, max_post_steps=16,
                                        max_steps_per_block=3)])
def test_outputs_hold_no_edit_tokens_and_prompts_never_change(tiny22, knobs):
    model, ids, prompts = tiny22
    scanned = 0
    for prompt in prompts:
        out = _generate(model, ids, prompt, max_new_tokens=64, **knobs)
        assert out.canvas[:len(prompt)] == prompt
        assert not {ids.mask_id, ids.delete_id, ids.split_id} & set(out.token_ids)
        assert not set(ids.stop_ids) & set(out.token_ids)
        assert len(out.token_ids) <= 64 and out.finish_reason in ("stop", "length")
        cap = knobs.get("max_steps_per_block", 1000)
        assert all(len(steps) <= cap for steps in out.accepted_per_step)
        scanned += out.scan_edits
    assert scanned > 0  # DELETE/SPLIT were written and consumed


def test_generation_is_deterministic_and_stops_on_a_stop_id(tiny22):
    model, ids, prompts = tiny22
    a = _generate(model, ids, prompts[0], max_new_tokens=96)
    b = _generate(model, ids, prompts[0], max_new_tokens=96)
    assert a.token_ids == b.token_ids and a.forwards == b.forwards
    full = _generate(model, ids, prompts[0], max_new_tokens=96, ignore_eos=True)
    if a.finish_reason == "stop":
        assert full.token_ids[len(a.token_ids)] in ids.stop_ids


class ScriptedModel(nn.Module):
    """Predicts script[position] at every position, whatever the input (vocab 16)."""

    def __init__(self, script, vocab=16):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.script, self.vocab = script, vocab

    def forward(self, ids, positions, attn):
        return positions.float()[:, None]

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab)
        for i, p in enumerate(hidden[:, 0].long().tolist()):
            logits[i, self.script[p]] = 10.0
        return logits


MASK, DELETE, SPLIT, EOS, STOP2 = 15, 14, 13, 12, 11


def _scripted(script, prompt, **kw):
    return reference_generate_llada22(ScriptedModel(script), prompt, mask_id=MASK, stop_ids=(EOS, STOP2),
                                      delete_id=DELETE, split_id=SPLIT, block_length=8, max_post_steps=2, **kw)


def test_a_request_stops_on_either_stop_id_but_not_on_one_in_its_prompt():
    script = [1] * 40
    script[13] = STOP2  # generated position 13 (prompt of 3)
    out = _scripted(script, [EOS, STOP2, 2], max_new_tokens=30)
    assert out.finish_reason == "stop" and out.token_ids == [1] * 10
    assert len(out.accepted_per_step) == 2  # the block after the stop id is never decoded
    script[13], script[6] = 1, EOS
    out = _scripted(script, [EOS, STOP2, 2], max_new_tokens=30)
    assert out.finish_reason == "stop" and out.token_ids == [1, 1, 1]


def test_literal_edit_ids_in_the_prompt_are_prompt_text():
    script = [4] * 16
    out = _scripted(script, [DELETE, SPLIT, MASK, 3, DELETE], max_new_tokens=8)
    assert out.canvas[:5] == [DELETE, SPLIT, MASK, 3, DELETE]
    assert out.token_ids == [4] * 8 and out.finish_reason == "length"


def test_delete_and_split_predictions_are_consumed_and_the_final_round_replaces_them():
    # every position predicts DELETE: each step deletes what it wrote until the final round (post
    # steps >= 2 after the original masks are gone) writes the best other token instead
    script = [DELETE] * 16
    out = _scripted(script, [3], max_new_tokens=7)
    assert DELETE not in out.token_ids and len(out.token_ids) == 7
    assert out.scan_edits > 0
