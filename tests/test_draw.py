"""The sampling draw (modules/draw.py, draw.cpp) against torch.multinomial: the same token for every row and the
generator left in the same state, bit for bit, wherever the draw starts in the Mersenne Twister's block."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from modules import draw

try:
    LIB = draw.library()
except Exception:  # no compiler here: the public function's fallback is still tested below
    LIB = None
needs_kernel = pytest.mark.skipif(LIB is None, reason="the draw kernel cannot be built on this machine")


def generator_at(seed: int, words: int) -> torch.Generator:
    """A generator `words` 32-bit draws past its seed (float32 uniform_ takes one word an element)."""
    g = torch.Generator().manual_seed(seed)
    torch.empty(words).uniform_(generator=g)
    return g


def probabilities(rows: int, V: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    if kind == "sparse":  # most of the row filtered out, as top-p leaves it
        logits[torch.rand(rows, V, generator=g) < 0.95] = float("-inf")
        logits[:, V // 2] = 0.0
    elif kind == "ties":
        logits[:, : (V + 1) // 2] = 1.0
    elif kind == "peaked":
        logits[:, V - 1] = 40.0
    return F.softmax(logits, dim=-1)


def kernel_draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    tokens = draw._draw(LIB, probs, g)
    assert tokens is not None
    return tokens


@needs_kernel
@pytest.mark.parametrize("V", [1, 2, 311, 312, 313, 1000, 50257])
@pytest.mark.parametrize("kind", ["dense", "sparse", "ties", "peaked"])
@pytest.mark.parametrize("words", [0, 1, 623, 624, 1247])  # fresh seed, odd positions, a pair across a twist
def test_the_kernel_draws_torchs_token_and_leaves_the_generator_as_torch_does(V, kind, words):
    probs = probabilities(3, V, kind, seed=V + words)
    theirs, ours = generator_at(5, words), generator_at(5, words)
    expected = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
    assert torch.equal(kernel_draw(probs, ours), expected)
    assert torch.equal(ours.get_state(), theirs.get_state())
    # and the next draws from both generators agree: the state is one torch can go on from
    assert torch.equal(torch.rand(5, generator=ours), torch.rand(5, generator=theirs))


@needs_kernel
def test_many_draws_in_a_row_follow_torch_token_by_token():
    """A sampled generation's pattern: one call per token, the generator carried from call to call."""
    theirs, ours = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    for step in range(200):
        probs = probabilities(2, 997, ("dense", "sparse", "peaked")[step % 3], seed=step)
        assert torch.equal(kernel_draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
    assert torch.equal(ours.get_state(), theirs.get_state())


def _zero_words_next(g: torch.Generator) -> torch.Generator:
    """The generator with its next two words 0 (so the next element's uniform is exactly 0, q = 0): the state words
    at its position set to 0 (tempering maps 0 to 0)."""
    state = g.get_state()
    left = int(state[8:12].view(torch.int32))
    nxt = int(state[16:24].view(torch.int64))
    assert left > 3 and nxt + left == 625
    words = state[24:24 + 8 * 624].view(torch.int64)
    words[nxt: nxt + 2] = 0
    crafted = torch.Generator()
    crafted.set_state(state)
    return crafted


@needs_kernel
@pytest.mark.parametrize("first", [0.0, 0.25])
def test_a_uniform_of_exactly_zero_gives_torchs_nan_or_infinity(first):
    """u == 0 gives q == 0: where the probability is 0 the ratio is 0/0 = NaN, which torch's argmax takes; where it is
    positive, infinity. Both pick element 0 here, as torch does, though other tokens have larger probabilities."""
    probs = torch.tensor([[first, 0.25, 0.5, 0.25 - first]])
    base = generator_at(3, 10)
    theirs, ours = _zero_words_next(base), _zero_words_next(base)
    expected = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
    assert expected.item() == 0
    assert torch.equal(kernel_draw(probs, ours), expected)
    assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("bad", ["nan", "inf", "negative", "zeros"])
def test_rows_torch_refuses_raise_torchs_error_and_leave_the_generator(bad):
    probs = probabilities(2, 50, "dense", seed=1)
    probs[1] = {"nan": probs[1].masked_fill(probs[1] > 0.02, float("nan")),
                "inf": probs[1].masked_fill(probs[1] > 0.02, float("inf")),
                "negative": probs[1] - 0.01, "zeros": torch.zeros(50)}[bad]
    theirs, ours = generator_at(1, 7), generator_at(1, 7)
    with pytest.raises(RuntimeError) as expected:
        torch.multinomial(probs, 1, generator=theirs)
    with pytest.raises(RuntimeError) as got:
        draw.multinomial(probs, ours)
    assert str(got.value) == str(expected.value)
    assert torch.equal(ours.get_state(), theirs.get_state())
    if LIB is not None:  # the kernel itself says so and writes nothing
        state = ours.get_state()
        assert LIB.draw_tokens(probs.data_ptr(), 2, 50, 50, state.data_ptr(), torch.empty(2, dtype=torch.long)
                               .data_ptr()) == 1
        assert torch.equal(state, ours.get_state())


@needs_kernel
def test_negative_zero_is_a_zero_probability_as_torch_takes_it():
    probs = torch.tensor([[-0.0, 0.5, 0.0, 0.5], [0.0, -0.0, 1.0, -0.0]])
    theirs, ours = generator_at(2, 3), generator_at(2, 3)
    assert torch.equal(kernel_draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
    assert torch.equal(ours.get_state(), theirs.get_state())


@needs_kernel
def test_a_position_torch_never_leaves_is_handed_to_torch_untouched():
    """left + next must be 625 (or left 1): a state set by hand to anything else is torch's to draw from."""
    state = generator_at(4, 30).get_state()
    state[8:12] = torch.tensor([5], dtype=torch.int32).view(torch.uint8)  # left 5 with next 30
    g = torch.Generator()
    g.set_state(state)
    assert draw._draw(LIB, probabilities(1, 40, "dense", seed=0), g) is None
    assert torch.equal(g.get_state(), state)
    theirs = torch.Generator()
    theirs.set_state(state)
    probs = probabilities(1, 40, "dense", seed=0)
    assert torch.equal(draw.multinomial(probs, g), torch.multinomial(probs, 1, generator=theirs).squeeze(1))


@pytest.mark.parametrize("case", ["1-d", "1-d float64", "float64", "bfloat16", "strided", "default-generator"])
def test_the_public_draw_equals_torch_multinomial_in_every_form(case):
    """Shapes and dtypes the kernel does not take go to torch; the ones it takes (a strided view, 1-D rows, torch's
    default generator when none is given) give torch's token either way."""
    probs = probabilities(4, 300, "sparse", seed=2)
    if case == "1-d":
        probs = probs[1]
    elif case == "1-d float64":  # torch's draw, one token without its sample dimension
        probs = probs[1].double()
    elif case in ("float64", "bfloat16"):
        probs = probs.to(getattr(torch, case))
    elif case == "strided":
        probs = probabilities(300, 4, "dense", seed=2).t()  # (4, 300), columns 4 floats apart: torch draws in
        # memory order there (its q keeps the view's strides), so torch draws
    if case == "default-generator":
        torch.manual_seed(9)
        expected = torch.multinomial(probs, 1).squeeze(-1)
        after = torch.default_generator.get_state()
        torch.manual_seed(9)
        assert torch.equal(draw.multinomial(probs), expected)
        assert torch.equal(torch.default_generator.get_state(), after)
        return
    theirs, ours = generator_at(6, 5), generator_at(6, 5)
    expected = torch.multinomial(probs, 1, generator=theirs).squeeze(-1)
    got = draw.multinomial(probs, ours)
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_the_kernel_is_used_only_where_it_reproduces_torch(monkeypatch):
    """applies() takes contiguous CPU float32 rows, 1 or 2 dims, without gradients, a CPU generator or none; a
    kernel that draws other tokens than torch.multinomial (a torch whose draws changed) is refused with a warning."""
    monkeypatch.setattr(draw, "_library", LIB or False)
    rows = torch.full((2, 5), 0.2)
    assert draw.applies(rows, None) is (LIB is not None)
    monkeypatch.setattr(draw, "_library", object())  # a loaded kernel, whatever it is
    assert draw.applies(rows, torch.Generator()) and draw.applies(rows[0], None) and draw.applies(torch.ones(1), None)
    for refused in (rows.double(), rows.bfloat16(), rows[None], torch.empty(2, 0), torch.empty(0, 5),
                    rows.clone().requires_grad_(), rows.t()):
        assert not draw.applies(refused, None)
    if torch.cuda.is_available():
        assert not draw.applies(rows.cuda(), None)
        assert not draw.applies(rows, torch.Generator(device="cuda"))

    class Wrong:  # draws the last token every time
        def draw_tokens(self, probs, rows, V, stride, state, out):
            last = torch.full((rows,), V - 1, dtype=torch.long)
            ctypes.memmove(out, last.data_ptr(), 8 * rows)
            return 0

    class Refusing:  # finds every state odd
        def draw_tokens(self, *args):
            return 2

    assert not draw.agrees(Wrong()) and not draw.agrees(Refusing())
    if LIB is not None:
        assert draw.agrees(LIB)
    real_loader = draw.rows.load_kernel
    monkeypatch.setattr(draw, "_library", None)
    monkeypatch.setattr(draw.rows, "load_kernel", lambda *args, **kwargs: Wrong())
    with pytest.warns(UserWarning, match="does not reproduce torch"):
        assert not draw.available()
    monkeypatch.setattr(draw.rows, "load_kernel", real_loader)
    monkeypatch.setattr(draw, "_library", None)
    monkeypatch.setenv(draw.ENV, "0")
    assert not draw.available()
    monkeypatch.setattr(draw, "_library", None)
    monkeypatch.delenv(draw.ENV)
    assert draw.available() is (LIB is not None)


@needs_kernel
def test_sampled_generation_is_the_same_with_the_kernel_and_with_torchs_draw(monkeypatch):
    """generate(do_sample=True) draws through modules/draw.py: the tokens are torch.multinomial's, kernel or not."""
    from conftest import padded_batch, tiny_config

    from tests.test_generation import load_pair

    config = tiny_config("h4-wide")
    _, ours = load_pair(config, seed=4)
    ids, mask = padded_batch([6, 3, 5], 6, config.vocab_size, "left", seed=9)
    runs = {}
    for kernel in (True, False):
        monkeypatch.setattr(draw, "_library", LIB if kernel else False)
        calls = []
        monkeypatch.setattr(draw, "_draw", lambda *a, _real=draw._draw: calls.append(1) or _real(*a))
        runs[kernel] = ours.generate(ids, mask, max_new_tokens=10, do_sample=True, temperature=1.3, top_p=0.95,
                                     generator=torch.Generator().manual_seed(3))
        assert len(calls) == (10 if kernel else 0)
        monkeypatch.undo()
    assert torch.equal(runs[True], runs[False])


def test_the_kernel_builds_where_there_is_a_compiler():
    """On x86-64 Linux with g++ the kernel must build (else every test above skips and sampling falls back)."""
    import platform
    import shutil
    import sys

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or not shutil.which("g++"):
        pytest.skip("not x86-64 Linux with g++")
    assert LIB is not None and draw.library().draw_tokens is not None


class Faulty:
    """The real kernel, made wrong in one case only: the self-check must see each case."""

    def __init__(self, case):
        self.case = case

    def draw_tokens(self, probs, rows, V, stride, state, out):
        import numpy as np

        at = np.ctypeslib.as_array(ctypes.cast(state, ctypes.POINTER(ctypes.c_uint8)), shape=(5056,))
        left, nxt = int(at[8:12].view(np.int32)[0]), int(at[16:24].view(np.int64)[0])
        code = LIB.draw_tokens(probs, rows, V, stride, state, out)
        p = np.ctypeslib.as_array(ctypes.cast(probs, ctypes.POINTER(ctypes.c_float)), shape=(rows, V))
        tokens = np.ctypeslib.as_array(ctypes.cast(out, ctypes.POINTER(ctypes.c_int64)), shape=(rows,))
        for r in range(rows):
            positive = int((p[r] > 0).sum())
            if {"fresh": left == 1, "odd": left != 1 and nxt % 2 == 1, "sparse": 1 < positive < V,
                    "single": positive == 1}.get(self.case, False):
                tokens[r] = (tokens[r] + 1) % V
        if self.case == "state":
            at[24] ^= 1  # a bit of the first state word: the tokens right, the generator not torch's
        return code


@needs_kernel
@pytest.mark.parametrize("case", ["fresh", "odd", "sparse", "single", "state"])
def test_the_self_check_finds_a_kernel_wrong_in_any_one_of_its_cases(case):
    """agrees() draws from a fresh generator and from an odd position, on a row of positive probabilities, a row
    with most of them 0 and a row with one: a kernel wrong in any one of those, or leaving another state, fails."""
    assert draw.agrees(LIB)
    assert not draw.agrees(Faulty(case))


def test_a_kernel_that_disagrees_is_refused_once_and_for_all(monkeypatch):
    """The loader names the kernel and what runs instead; a kernel that disagrees with torch is dropped with one
    warning, and later calls neither load nor warn again."""
    loads = []

    class Wrong:
        def draw_tokens(self, *args):
            return 2

    def loader(env, build, what, otherwise, **kwargs):
        loads.append((env, what, otherwise))
        return Wrong()

    monkeypatch.setattr(draw, "_library", None)
    monkeypatch.setattr(draw.rows, "load_kernel", loader)
    with pytest.warns(UserWarning, match=r"modules/draw.cpp does not reproduce torch .*'s multinomial here; sampling "
                                         r"draws with torch.multinomial"):
        assert not draw.available()
    assert loads == [(draw.ENV, "the sampling draw kernel modules/draw.cpp", "sampling draws with torch.multinomial")]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not draw.available() and not draw.applies(torch.ones(3), None)
    assert len(loads) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_generator_goes_to_torch():
    with pytest.raises(RuntimeError):  # torch's own refusal of a CUDA generator for CPU probabilities
        draw.multinomial(torch.full((2, 5), 0.2), torch.Generator(device="cuda"))
