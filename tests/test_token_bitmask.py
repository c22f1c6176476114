"""Structured output's mask: the compiled kernel at every instruction-set level this machine
runs equals the torch reference and a plain per-token loop, and the grammar processor on the
sampler follows each row's outputs (also while drafts are verified) without a model."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import compiled_ops, isa
from tests.helpers import ops_of


@pytest.fixture(scope="module", params=["torch", *isa.tested_levels()])
def ops(request):
    return ops_of(request.param)


def _by_loop(logits, bitmask, rows, mask_rows):
    out = logits.clone()
    for row, mask_row in zip(rows.tolist(), mask_rows.tolist()):
        words = [w & 0xFFFFFFFF for w in bitmask[mask_row].tolist()]
        allowed = [(words[t // 32] >> (t % 32)) & 1 for t in range(out.shape[1])]
        if any(allowed):
            out[row] = torch.where(torch.tensor(allowed, dtype=torch.bool), out[row],
                                   float("-inf"))
    return out


@pytest.mark.parametrize("vocab", [7, 100, 1000, 4133])
def test_kernel_masks_exactly_the_cleared_bits(ops, vocab):
    """Random words, all-set and all-clear words, a mask that allows nothing (left alone), a
    vocabulary that ends mid-word, and a subset of rows in another order than the masks."""
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=generator,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2] = 0  # nothing: the row stays as it is
    bitmask[3, : words // 2] = 0
    bitmask[4] = 0
    bitmask[4, -1] = 1 << ((vocab - 1) % 32)  # only the last token
    logits = torch.randn(7, vocab, generator=generator)
    rows, mask_rows = torch.tensor([6, 0, 2, 3, 5]), torch.tensor([0, 1, 2, 3, 4])
    expected = _by_loop(logits, bitmask, rows, mask_rows)
    masked = logits.clone()
    ops.apply_token_bitmask_(masked, bitmask, rows, mask_rows)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[1, 4]], logits[[1, 4]])  # rows not named are untouched
    assert int(masked[5].isfinite().sum()) == 1 and masked[5, -1] == logits[5, -1]


@pytest.mark.parametrize("level", isa.tested_levels())
def test_kernel_refuses_a_row_out_of_range(level):
    with pytest.raises(RuntimeError, match="out of range"):
        compiled_ops(level).apply_token_bitmask_(
            torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([2]),
            torch.tensor([0]))


# ---- the grammar processor on the sampler (the real tokenizer and xgrammar, no model) ------
@pytest.fixture(scope="module")
def grammar_setup():
    from kvserve.model_source import resolve_model
    from kvserve.structured_output.compiler import GrammarCompiler
    from kvserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler(lambda: tokenizer, vocab)
    yield tokenizer, vocab, compiler
    compiler.shutdown()


def _constrained(compiler, eos, **spec):
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(**spec))
    params.all_stop_token_ids = {eos}
    compiler.submit(params.structured_outputs).result()
    return params


def _sampler(tokenizer, vocab):
    from kvserve.sample.sampler import Sampler
    from kvserve.structured_output.compiler import GrammarCompiler
    from kvserve.structured_output.processor import GrammarProcessor

    return Sampler(0, logits_processors=[GrammarProcessor(GrammarCompiler(lambda: tokenizer,
                                                                          vocab))])


def _run_plain(sampler, rows, steps, vocab, seed):
    """Greedy steps on random logits, each token appended as the worker does; the logits."""
    generator = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        logits = torch.randn(len(rows), vocab, generator=generator)
        seen.append(logits)
        for row, token in zip(rows, sampler(logits, rows).token_ids):
            row.output_token_ids.append(token)
    return seen


def test_grammar_rows_follow_their_grammar_and_free_rows_are_untouched(grammar_setup):
    """Random logits: the constrained row still spells what its regex allows, then EOS; the
    unconstrained row beside it takes the argmax of its raw logits every step."""
    import re

    from kvserve.sample.sampler import SamplingRow
    from kvserve.sampling_params import SamplingParams

    tokenizer, vocab, compiler = grammar_setup
    eos = tokenizer.eos_token_id
    rows = [SamplingRow(_constrained(compiler, eos, regex=r"[0-9]{3}-(yes|no)"), [1], [], None),
            SamplingRow(SamplingParams(temperature=0), [1], [], None)]
    sampler = _sampler(tokenizer, vocab)
    generator = torch.Generator().manual_seed(3)
    for _ in range(12):
        logits = torch.randn(2, vocab, generator=generator)
        tokens = sampler(logits.clone(), rows).token_ids
        assert tokens[1] == int(logits[1].argmax())
        for row, token in zip(rows, tokens):
            row.output_token_ids.append(token)
        if tokens[0] == eos:
            break
    constrained = rows[0].output_token_ids
    assert constrained[-1] == eos
    assert re.fullmatch(r"[0-9]{3}-(yes|no)", tokenizer.decode(constrained[:-1]))


def test_verifying_drafts_masks_every_depth(grammar_setup):
    """Drafts equal to what plain steps chose are all accepted and give the same tokens; a draft
    the grammar forbids is never accepted, even where it is the raw argmax."""
    from kvserve.sample.sampler import SamplingRow

    tokenizer, vocab, compiler = grammar_setup
    eos = tokenizer.eos_token_id

    def fresh_row():
        return SamplingRow(_constrained(compiler, eos, choice=["alpha beta gamma delta"]), [1],
                           [], None)

    plain_row = fresh_row()
    steps = _run_plain(_sampler(tokenizer, vocab), [plain_row], 4, vocab, seed=5)
    plain = list(plain_row.output_token_ids)
    assert tokenizer.decode(plain).startswith("alpha")

    drafted = _sampler(tokenizer, vocab).verify(
        torch.cat(steps), [fresh_row()], [plain[:3]]).token_ids
    assert drafted == [plain]

    forbidden = tokenizer.encode(" zebra", add_special_tokens=False)[0]
    logits = torch.cat(steps[:2])
    logits[0, forbidden] = 1e4  # the raw argmax at depth 0, outside the grammar
    rejected = _sampler(tokenizer, vocab).verify(logits, [fresh_row()], [[forbidden]]).token_ids
    assert rejected == [[plain[0]]]


# ---- grammar-aware drafts (the engine core's side) ------------------------------------------
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Rome"]}}}


def _grammar_drafts(tokenizer, vocab):
    from kvserve.structured_output.compiler import GrammarCompiler
    from kvserve.structured_output.drafts import GrammarDrafts

    return GrammarDrafts(GrammarCompiler(lambda: tokenizer, vocab), lambda: tokenizer,
                         max_drafts=8)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_forced_spans_are_drafted_as_the_tokens_of_the_text(grammar_setup, backend,
                                                            monkeypatch):
    """After a field's value the grammar forces the next key: that span is the draft, the
    tokenizer's own tokens for it, less a last token that could merge with what follows;
    where nothing is forced the proposer's drafts are cut at the first token the grammar
    forbids, and a forbidden draft leaves the request's matcher usable (llguidance's would
    stay in an error state after consuming it)."""
    from kvserve.sampling_params import StructuredOutputsParams

    monkeypatch.setenv("KVSERVE_STRUCTURED_OUTPUTS_BACKEND", backend)
    tokenizer, vocab, _ = grammar_setup
    drafts = _grammar_drafts(tokenizer, vocab)
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    drafts.compiler.submit(spec).result()
    text = '{"name": "Bob", "age": 7, "city": "Paris"}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefix = tokenizer.encode('{"name": "Bob",', add_special_tokens=False)
    assert ids[:len(prefix)] == prefix
    span, forced = drafts.drafts("r", spec, prefix, proposed=[])
    assert forced and tokenizer.decode(span) == ' "age":'  # the space may merge with "7"
    assert span == ids[len(prefix):len(prefix) + len(span)]
    longer = ids[len(prefix):len(prefix) + len(span) + 2]
    same, forced = drafts.drafts("r", spec, prefix, proposed=longer)
    assert same == longer and not forced  # the context's drafts go on past the span
    inside_name = tokenizer.encode('{"name": "B', add_special_tokens=False)
    free_text = tokenizer.encode('ob is', add_special_tokens=False)
    cut, forced = drafts.drafts("s", spec, inside_name, proposed=free_text)
    assert not forced and cut == free_text  # anything goes inside a string
    before_age = ids[:ids.index(tokenizer.encode(" 7", add_special_tokens=False)[-1])]
    digits, forced = drafts.drafts("r", spec, before_age,
                                   proposed=tokenizer.encode("x1", add_special_tokens=False))
    assert not forced and digits == []  # "x" cannot start an integer
    after_age = tokenizer.encode('{"name": "Bob", "age": 7,', add_special_tokens=False)
    assert ids[:len(after_age)] == after_age
    span, forced = drafts.drafts("r", spec, after_age, proposed=[])
    assert forced and tokenizer.decode(span).startswith(' "city"')
    drafts.finish("r")
    drafts.compiler.shutdown()


@pytest.mark.slow
def test_constrained_greedy_tokens_equal_with_and_without_drafts():
    """The real model in float32, a JSON schema, speculation on (every draft used: adaptive
    off) and off: the same tokens; forced spans were drafted and most were accepted."""
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec)
    outputs = {}
    for name, speculative in (("off", None), ("on", {"method": "ngram",
                                                     "num_speculative_tokens": 8,
                                                     "adaptive": False})):
        llm = LLM(dtype="float32", engine_core="thread", speculative_config=speculative)
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in
                   ("Describe a person as JSON.", "Who lives in Rome? Answer in JSON.")]
        outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
    assert [o.token_ids for o in outputs["on"]] == [o.token_ids for o in outputs["off"]]
    drafted = sum(o.num_draft_tokens for o in outputs["on"])
    accepted = sum(o.num_accepted_tokens for o in outputs["on"])
    assert drafted >= 10 and accepted >= 0.7 * drafted, (accepted, drafted)
