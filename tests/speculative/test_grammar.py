"""Structured outputs and logprobs where verification happens (speculative.grammar, speculative.verify):

- greedy speculation under a JSON schema gives token for token what transformers' generate gives with the
  same schema as a logits processor (tests.support.grammar_reference: llguidance's own matcher, fed the whole output at
  every step, never speculative.grammar), whatever the drafts: the target's own unmasked choices (which the
  grammar often refuses), the reference answer with holes (full hits, bonus tokens), random tokens;
- the answers parse and fit the schema;
- the log-probabilities of the committed tokens (and the top 5) equal log_softmax of generate's raw logits;
- sampling under a grammar keeps the target's constrained distribution (softmax of the masked logits over T,
  cut to the nucleus, written here), with a drafter that ignores the grammar and one that follows it;
- the Grammar object: rollback restores the mask, a refused token is an error, bad response_formats are one line.
"""
import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoTokenizer

from netbridge.protocol import SamplingParams
from speculative.grammar import GrammarError, GrammarFailure, Grammars, grammar_source, schema_of
from speculative.verify import token_logprobs, verify
from tests.support.grammar_reference import BOMB, ReferenceGrammar, constrained_greedy, late_bomb
from tests.support.session_harness import serve, serve_together, session_args
from tests.support.tiny_models import VOCAB, load_reference, reference_greedy, save_tiny, save_tiny_tokenizer

EOS = 0  # the tiny tokenizer's <eos>
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}}
PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]
MAX_NEW = 60
K = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny qwen2 with a tokenizer whose <eos> (0) ends the answer. Its head unscaled: logits within ~10, where
    fp32's rounding (a cache or not, other block shapes) moves a log-probability by ~2e-5, not the ~1e-4 of
    logits near 40 (the default head scale)."""
    folder = save_tiny(tmp_path_factory.mktemp("grammar") / "qwen2", "qwen2", seed=5, eos=EOS, head_scale=1.0)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return load_reference(folder), tokenizer, Grammars(tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module")
def expected(tiny):
    """generate's answer under the schema and its raw logits at each step."""
    return reference(tiny[0], tiny[1])


def reference(model, tokenizer, schema=SCHEMA):
    """(tokens, raw logits per step) of generate(do_sample=False) under the grammar (tests.support.grammar_reference)."""
    return constrained_greedy(model, tokenizer, PROMPT, schema, MAX_NEW, EOS)


def ReferenceAfter(tokenizer, tokens, schema={"type": "object"}) -> torch.Tensor:
    """The reference's mask after `tokens`."""
    ref = ReferenceGrammar(tokenizer, schema, 0, VOCAB, EOS)
    assert ref.matcher.consume_tokens(tokens)
    return ref.allowed()


# ---- speculation: a plain loop of rounds around speculative.verify, with one of three drafters ----------
def speculate(model, grammar, drafter, temperature=0.0, seed=0):
    """Rounds of K drafts verified by speculative.verify against the full forward of the model (no cache);
    returns the committed tokens and their TokenLogprobs rows (top 5)."""
    committed, chosen, tops, top_ids = [], [], [], []
    generator = torch.Generator().manual_seed(seed)
    while len(committed) < MAX_NEW and EOS not in committed:
        drafts = drafter(committed)[:min(K, MAX_NEW - len(committed) - 1)]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + committed + drafts])).logits[0, -(len(drafts) + 1):].float()
        grammar.rewind(len(committed))
        accepted, token = verify(logits, torch.tensor(drafts, dtype=torch.long), temperature, 1.0, generator,
                                 grammar=grammar)
        new = drafts[:accepted] + [token]
        lp = token_logprobs(logits, new, 5)
        committed += new
        chosen.append(lp.chosen), tops.append(lp.top), top_ids.append(lp.top_ids)
    return committed, torch.cat(chosen), torch.cat(tops), torch.cat(top_ids)


def unmasked_drafter(model, answer):
    """The target's own argmax without the grammar at each position of the answer (one forward over it): the
    first draft is the token the target itself prefers there, which the grammar often refuses."""
    with torch.no_grad():
        best = model(torch.tensor([PROMPT + answer])).logits[0, len(PROMPT) - 1:].argmax(-1).tolist()
    return lambda committed: best[len(committed):len(committed) + K]


def holed_drafter(answer):
    """The right answer with one wrong token in every other block: full hits, bonus tokens and misses."""
    def propose(committed):
        drafts = answer[len(committed):len(committed) + K]
        if len(committed) % 2 and drafts:
            drafts[len(committed) % len(drafts)] = (drafts[len(committed) % len(drafts)] + 1) % VOCAB
        return drafts
    return propose


def random_drafter(committed):
    g = torch.Generator().manual_seed(len(committed))
    return torch.randint(0, VOCAB, (K,), generator=g).tolist()


# random drafts (padding rows among them) commit one token a round: 44 forwards, under -m slow
@pytest.mark.parametrize("drafts", ["unmasked", "holed", pytest.param("random", marks=pytest.mark.slow)])
def test_greedy_under_a_schema_equals_generate_with_the_grammar_and_parses(tiny, expected, drafts):
    model, tokenizer, grammars = tiny
    answer = expected[0]
    drafter = {"unmasked": unmasked_drafter(model, answer), "holed": holed_drafter(answer),
               "random": random_drafter}[drafts]
    tokens = speculate(model, grammars.make(FORMAT), drafter)[0]
    assert tokens == answer
    assert answer[-1] == EOS  # the grammar ended the answer, not max_new_tokens
    parsed = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))  # and it fits the schema
    assert set(parsed) == {"name", "n", "ok"}
    assert isinstance(parsed["name"], str) and len(parsed["name"]) <= 6
    assert type(parsed["n"]) is int and 0 <= parsed["n"] <= 99
    assert type(parsed["ok"]) is bool


def test_logprobs_are_log_softmax_of_the_targets_logits(tiny, expected):
    model, tokenizer, grammars = tiny
    answer = expected[0]
    tokens, chosen, top, top_ids = speculate(model, grammars.make(FORMAT), holed_drafter(answer))
    assert tokens == answer
    reference_lp = forward_logprobs(model, answer)
    torch.testing.assert_close(chosen, reference_lp.gather(-1, torch.tensor(answer)[:, None])[:, 0], atol=1e-4, rtol=0)
    ref_top, ref_ids = reference_lp.topk(5, -1)
    torch.testing.assert_close(top, ref_top, atol=1e-4, rtol=0)
    assert torch.equal(top_ids, ref_ids)
    assert (chosen < -1e-3).any()  # raw: the chosen tokens are not certain (T and the mask do not enter)


def forward_logprobs(model, answer: list[int]) -> torch.Tensor:
    """log_softmax of transformers' forward over the prompt and the answer, at the rows that chose each token."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT + answer])).logits[0, len(PROMPT) - 1:-1].float(), -1)


@pytest.mark.parametrize("in_flight", [pytest.param(1, marks=pytest.mark.slow), 3])  # 3 covers 1's path too
def test_the_last_rank_masks_and_returns_logprobs_through_a_session(tiny, folder, expected, tmp_path, in_flight):
    """Both ranks (session_harness): the grammar and the logprobs request travel in the Request, the last rank
    masks (with rounds in flight: some verified on a bet and dropped) and its Replies' logprobs reach Output;
    the next request, without a grammar, is the target's own answer again."""
    model, _, _ = tiny
    draft = save_tiny(tmp_path / "draft", "qwen2", seed=7, layers=2)  # mostly wrong: bets fail, drafts refused
    gens = serve(session_args(folder, draft, max_new=MAX_NEW) + [f"spec.in_flight={in_flight}"],
                 [(PROMPT, SamplingParams(grammar=grammar_source(SCHEMA), logprobs=3)), (PROMPT, SamplingParams())])
    answer = expected[0]
    assert gens[0].output.tokens == answer
    reference_lp = forward_logprobs(model, answer)
    got = gens[0].output.logprobs
    torch.testing.assert_close(torch.tensor([lp for lp, _ in got]),
                               reference_lp.gather(-1, torch.tensor(answer)[:, None])[:, 0], atol=1e-4, rtol=0)
    ref_top, ref_ids = reference_lp.topk(3, -1)
    assert [[t for t, _ in top] for _, top in got] == ref_ids.tolist()
    torch.testing.assert_close(torch.tensor([[lp for _, lp in top] for _, top in got]), ref_top, atol=1e-4, rtol=0)
    assert gens[1].output.tokens == reference_greedy(folder, PROMPT, MAX_NEW, eos=EOS) != answer
    assert gens[1].output.logprobs == []
    if in_flight > 1:
        assert sum(r.bets_lost for r in gens[0].rounds) > 0  # rounds were verified on a bet and dropped


# ---- sampling under a grammar: a Markov-chain target over the tiny vocabulary, schema {"type": "integer"} ---
TEMPERATURE, TOP_P, START, TRIALS = 0.7, 0.8, 5, 1200


def chain_logits() -> torch.Tensor:
    """Logits of the next token given the last one [V, V]; the end token favoured, so whether the grammar allows
    it (after a digit, not at the start) shapes the second token's distribution."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)) * 1.5
    logits[:, EOS] += 3.0
    return logits


def reference_probs(logits, allowed, temperature, top_p) -> np.ndarray:
    """softmax over the allowed tokens of logits / T, then the nucleus (the most likely while the mass before is
    below top_p), renormalized; float64."""
    z = np.where(allowed, np.asarray(logits, np.float64) / temperature, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    out, mass = np.zeros_like(p), 0.0
    for token in np.argsort(-p, kind="stable"):
        if mass >= top_p:
            break
        out[token], mass = p[token], mass + p[token]
    return out / out.sum()


def reference_pairs(tokenizer, temperature) -> np.ndarray:
    """The joint distribution of the first two tokens [V, V] under the grammar, through llguidance directly."""
    logits = chain_logits().numpy()
    first = ReferenceGrammar(tokenizer, {"type": "integer"}, 0, VOCAB, EOS)
    p1 = reference_probs(logits[START], first.allowed().numpy(), temperature, TOP_P)
    joint = np.zeros((VOCAB, VOCAB))
    for t1 in np.flatnonzero(p1):
        assert first.matcher.consume_token(int(t1))
        joint[t1] = p1[t1] * reference_probs(logits[t1], first.allowed().numpy(), temperature, TOP_P)
        first.matcher.rollback(1)
    return joint


def sample_pairs(grammars, drafter: str) -> np.ndarray:
    """TRIALS rounds of 2 drafts after START, verified under the grammar; counts of the first two emitted tokens."""
    logits, grammar = chain_logits(), grammars.from_schema({"type": "integer"})
    q_table = torch.softmax(logits, -1)  # the chain at T=1 without the grammar: mostly tokens it refuses
    g, counts = torch.Generator().manual_seed(1), np.zeros((VOCAB, VOCAB))
    for _ in range(TRIALS):
        grammar.rewind(0)
        last, drafts, qs = START, [], []
        for _ in range(2):
            q = q_table[last] if drafter == "ignores" else torch.softmax(grammar.mask_logits(logits[last]), -1)
            token = int(torch.multinomial(q, 1, generator=g))
            if drafter == "follows":
                grammar.accept(token)
            drafts, qs, last = drafts + [token], qs + [q], token
        grammar.rewind(0)
        rows = logits[[START] + drafts]
        n, token = verify(rows, torch.tensor(drafts), TEMPERATURE, TOP_P, g, torch.arange(VOCAB).expand(2, VOCAB),
                          torch.stack(qs), grammar=grammar)
        emitted = drafts[:n] + [token]
        if len(emitted) < 2:  # the second token: the next round's first, from the committed state
            grammar.rewind(1)
            emitted.append(int(verify(logits[emitted[0]][None], torch.zeros(0, dtype=torch.long), TEMPERATURE, TOP_P,
                                      g, grammar=grammar)[1]))
        counts[emitted[0], emitted[1]] += 1
    return counts


def chi2_pvalue(observed, probs) -> float:
    observed, expected = observed.ravel(), probs.ravel() * observed.sum()
    if np.any(observed[expected == 0] > 0):
        return 0.0  # a pair the constrained distribution cannot produce
    big = expected >= 5
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("drafter", ["ignores", "follows"])
def test_sampling_under_a_grammar_keeps_the_constrained_distribution(tiny, drafter):
    _, tokenizer, grammars = tiny
    counts = sample_pairs(grammars, drafter)
    pvalue = chi2_pvalue(counts, reference_pairs(tokenizer, TEMPERATURE))
    wrong = chi2_pvalue(counts, reference_pairs(tokenizer, 1.0))  # power: the same check at T=1
    print(f"{drafter}: p={pvalue:.3g}; against T=1: p={wrong:.3g}")
    assert pvalue > 1e-3
    assert wrong < 1e-6


# ---- the Grammar object ------------------------------------------------------------------------------
def test_rollback_restores_the_mask_and_a_refused_token_is_an_error(tiny):
    _, tokenizer, grammars = tiny
    grammar = grammars.make({"type": "json_object"})
    tokens = tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)
    before = grammar.allowed()
    assert before[tokenizer.encode("{", add_special_tokens=False)[0]] and not before[tokenizer.encode("x")[0]]
    for token in tokens:
        assert grammar.allows(token)
        grammar.accept(token)
    assert grammar.allowed().nonzero().flatten().tolist() == [EOS]  # the object is complete: only the end
    grammar.rewind(1)
    assert torch.equal(grammar.allowed(), ReferenceAfter(tokenizer, tokens[:1]))
    grammar.rewind(0)
    assert torch.equal(grammar.allowed(), before)
    with pytest.raises(RuntimeError, match="refused token .* doesn't satisfy the grammar") as info:
        grammar.accept(tokenizer.encode("x")[0])
    assert "\n" not in str(info.value)


def test_the_end_token_after_a_complete_answer_rolls_back(tiny):
    """Once the grammar is complete the matcher takes the end token without counting it (llguidance)."""
    _, tokenizer, grammars = tiny
    grammar = grammars.from_schema({"type": "integer"})
    for token in tokenizer.encode("0", add_special_tokens=False) + [EOS]:  # "0" completes an integer
        grammar.accept(token)
    grammar.rewind(0)
    assert torch.equal(grammar.allowed(), ReferenceAfter(tokenizer, [], {"type": "integer"}))




@pytest.mark.parametrize("response_format,message", [
    ({"type": "xml"}, "type 'xml' is not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "the schema object is missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "cannot be enforced"),
    ("json", "must be an object"),
])
def test_a_bad_response_format_is_one_line_naming_it(tiny, response_format, message):
    with pytest.raises(GrammarError, match=message) as info:
        tiny[2].make(response_format)
    assert "\n" not in str(info.value)


def test_text_asks_for_no_grammar():
    assert schema_of(None) is None and schema_of({"type": "text"}) is None


def test_top_logprobs_above_20_is_refused():
    with pytest.raises(ValueError, match="between 0 and 20"):
        token_logprobs(torch.zeros(1, 30), [0], 21)


def test_at_follows_the_committed_answer_through_rounds_sent_on_a_failed_bet(tiny):
    """The last rank's grammar at each round (Grammar.at, by the position the round decides): rounds sent ahead on
    a bet that failed (beyond what the grammar holds; or within it, on another token) leave it able to go on with
    the real answer."""
    _, tokenizer, grammars = tiny
    real = tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)
    origin, i = 40, real.index(tokenizer.encode("1", add_special_tokens=False)[0])
    grammar = grammars.make({"type": "json_object"})
    assert grammar.at(origin)  # the first round fixes where the answer starts
    for token in real[:i + 1]:
        grammar.accept(token)
    assert not grammar.at(origin + i + 3) and grammar.tokens == real[:i + 1]  # a bet beyond the answer: untouched
    assert grammar.at(origin + i + 1) and grammar.tokens == real[:i + 1]  # a bet at the answer's end
    for token in tokenizer.encode("]}", add_special_tokens=False):  # that round's own picks (dropped)
        grammar.accept(token)
    assert grammar.at(origin + i + 1) and grammar.tokens == real[:i + 1]  # the real round after it
    assert torch.equal(grammar.allowed(), ReferenceAfter(tokenizer, real[:i + 1]))
    assert grammar.at(origin + 2) and grammar.tokens == real[:2]  # a rewind as far as rank 0 says


# ---- a grammar llguidance gives up on (issue 39): a 400 when its first tokens show it, else its request alone ends --
def test_a_grammar_that_fails_on_its_first_tokens_is_refused_by_the_check(tiny):
    """Grammars.check (the request checks on rank 0) walks the answer's start as the last rank would, and each regex
    of the schema alone: the million-repetition pattern fails there, in one line naming llguidance's cause, at the
    top of the schema or past the walk's reach (late_bomb); ordinary schemas pass."""
    grammars = tiny[2]
    with pytest.raises(GrammarError, match="first tokens .*too many expressions constructed") as info:
        grammars.check(grammar_source(BOMB))
    assert "\n" not in str(info.value)
    grammars.check(grammar_source(late_bomb()))  # the walk alone does not get to its pattern...
    with pytest.raises(GrammarError, match="pattern '\\^a\\{1000000\\}\\$' .*too many expressions constructed"):
        grammars.check(grammar_source(late_bomb()), late_bomb())  # ...its regexes walked alone do
    for schema in (SCHEMA, {"type": "object"}, {"type": "integer"}, {"enum": [{"pattern": "(unclosed"}]},
                   {"type": "string", "pattern": "^[a-z]{2,8}$"}):
        grammars.check(grammar_source(schema), schema)


def test_a_grammar_that_fails_while_verifying_ends_its_own_request_alone(tiny, folder, expected, tmp_path):
    """late_bomb's grammar (sent without the request checks) fails on the last rank once its answer reaches the
    pattern: that request ends with the cause (Generation.error), while a plain request served at the same time gives
    the target's own answer, and the request after them, given the failed one's slot, its answer under SCHEMA."""
    draft = save_tiny(tmp_path / "draft", "qwen2", seed=7, layers=2)
    requests = [(PROMPT, SamplingParams(grammar=grammar_source(late_bomb(8)))), (PROMPT, SamplingParams(), 24),
                (PROMPT, SamplingParams(grammar=grammar_source(SCHEMA)))]
    gens, _ = serve_together(session_args(folder, draft, max_new=MAX_NEW), requests, slots=2)
    assert "too many expressions constructed" in gens[0].error
    assert len(gens[0].output.tokens) > 8  # it failed midway: after the string's 8 characters
    assert gens[1].error is None and gens[1].output.tokens == reference_greedy(folder, PROMPT, 24, eos=EOS)
    assert gens[2].error is None and gens[2].output.tokens == expected[0]
    assert gens[2].rounds[0].slot == gens[0].rounds[0].slot != gens[1].rounds[0].slot


@pytest.mark.slow  # the test above covers the same failure among others; this is the one-at-a-time loop's
def test_a_lone_generation_whose_grammar_fails_raises_it(folder, tmp_path):
    """Session.generate (one request at a time) raises the failure; the session serves the next request."""
    draft = save_tiny(tmp_path / "draft", "qwen2", seed=7, layers=2)
    gens = serve(session_args(folder, draft, max_new=MAX_NEW),
                 [(PROMPT, SamplingParams(grammar=grammar_source(late_bomb()))), (PROMPT, SamplingParams())], keep_going=True)
    assert isinstance(gens[0], GrammarFailure) and "too many expressions constructed" in str(gens[0])
    assert gens[1].output.tokens == reference_greedy(folder, PROMPT, MAX_NEW, eos=EOS)
