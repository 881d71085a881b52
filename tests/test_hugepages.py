"""modules/hugepages.py: a loaded model's parameters moved into one mapping that asks for 2 MiB pages keep their
objects, values, dtypes, shapes and strides; the mapping is eligible for huge pages where the kernel gives them
(THPeligible in /proc/self/smaps); a model so placed computes, trains (20 AdamW steps, fused and not) and decodes
bit for bit as the same model in torch's own allocations; GPT2_HUGE_PAGES=0, small models and views into a shared
buffer stay where they are."""
import copy
import io
import pickle

import pytest
import torch

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import hugepages
from optimizer import AdamW

needs_thp = pytest.mark.skipif(not hugepages.available(),
                               reason=f"no transparent huge pages here (THP mode {hugepages.mode() or 'unknown'})")


def thp_eligible(ptr: int) -> bool | None:
    """THPeligible of the mapping holding address `ptr` (/proc/self/smaps), None where not found."""
    start = end = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(a, 16) for a in head.split("-"))
            start, end = lo, hi
        elif head == "THPeligible:" and start is not None and start <= ptr < end:
            return line.split()[1] == "1"
    return None


def layers(width=1024, n=2):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])


@pytest.fixture
def saved(tmp_path):
    """A gpt2-shaped model of 2.6 MB of weights (more than one huge page), saved in HF's format."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=4000, n_positions=64))
    model.save_pretrained(tmp_path)
    return tmp_path


@needs_thp
def test_placed_parameters_keep_objects_values_and_layout_in_one_eligible_mapping():
    m = layers()
    m.register_parameter("odd", torch.nn.Parameter(torch.randn(300, 200).t()))  # a transposed layout
    before = [(p, p.detach().clone(), p.stride(), p.data_ptr()) for p in m.parameters()]
    moved = hugepages.place(m)
    assert moved >= sum(p.numel() * 4 for p, *_ in before)
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert all(p is q for (p, *_), q in zip(before, m.parameters()))  # the same Parameter objects
    for (p, value, stride, old), ptr in zip(before, ptrs):
        assert torch.equal(p, value) and p.stride() == stride and p.requires_grad and ptr != old and ptr % 64 == 0
    assert ptrs == sorted(ptrs) and ptrs[0] % hugepages.HUGE == 0  # packed in order from a 2 MiB boundary
    assert thp_eligible(ptrs[0]) is True and thp_eligible(before[0][3]) is not True


@needs_thp
def test_small_models_views_and_the_switch_stay_where_they_are(monkeypatch):
    small = torch.nn.Linear(64, 64)
    ptr = small.weight.data_ptr()
    assert hugepages.place(small) == 0 and small.weight.data_ptr() == ptr  # less than one huge page in all
    flat = torch.zeros(2 * 1024 * 1024)  # a flat buffer: its views keep pointing into it
    m = torch.nn.Module()
    m.a, m.b = (torch.nn.Parameter(flat[i * 2**20:(i + 1) * 2**20].view(1024, 1024)) for i in range(2))
    assert hugepages.place(m) == 0 and m.a.data_ptr() == flat.data_ptr()
    assert hugepages.place(m, views=True) > 0 and m.a.data_ptr() != flat.data_ptr()
    monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
    big = layers()
    ptr = big[0].weight.data_ptr()
    assert not hugepages.available() and hugepages.place(big) == 0 and big[0].weight.data_ptr() == ptr
    t = torch.randn(1024, 1024)
    assert hugepages.copy(t) is t


@needs_thp
def test_copy_gives_the_same_values_in_an_eligible_mapping():
    t = torch.randn(1024, 1024)
    c = hugepages.copy(t)
    assert c is not t and torch.equal(c, t) and c.stride() == t.stride() and thp_eligible(c.data_ptr())
    assert hugepages.copy(torch.randn(10)).numel() == 10  # small: itself


def test_from_pretrained_places_cpu_weights_and_decodes_the_same_tokens(saved, monkeypatch):
    monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
    plain = GPT2LMHeadModel.from_pretrained(saved)
    monkeypatch.delenv("GPT2_HUGE_PAGES")
    placed = GPT2LMHeadModel.from_pretrained(saved)
    ptrs = [p.data_ptr() for p in placed.parameters()]
    if hugepages.available():
        assert thp_eligible(ptrs[0]) and max(ptrs) - min(ptrs) < sum(p.numel() * 4 + 64 for p in placed.parameters())
    for (name, a), b in zip(plain.state_dict().items(), placed.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 4000, (1, 12))
    with torch.no_grad():
        assert torch.equal(plain(ids)["logits"], placed(ids)["logits"])
        for quantize in (None, "int8"):
            assert torch.equal(plain.generate(ids, max_new_tokens=8, do_sample=False, quantize=quantize),
                               placed.generate(ids, max_new_tokens=8, do_sample=False, quantize=quantize))


@pytest.mark.parametrize("fused", [False, True])
def test_twenty_training_steps_match_the_unplaced_model_bit_for_bit(saved, monkeypatch, fused):
    monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
    plain = GPT2LMHeadModel.from_pretrained(saved).train()
    monkeypatch.delenv("GPT2_HUGE_PAGES")
    placed = GPT2LMHeadModel.from_pretrained(saved).train()
    opts = [AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=fused) for m in (plain, placed)]
    torch.manual_seed(1)
    batches = [torch.randint(0, 4000, (2, 16)) for _ in range(20)]
    for ids in batches:
        losses = []
        for m, opt in zip((plain, placed), opts):
            torch.manual_seed(2)  # the same dropout masks
            loss = torch.nn.functional.cross_entropy(m(ids)["logits"][:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    for a, b in zip(plain.parameters(), placed.parameters()):
        assert torch.equal(a, b)


@needs_thp
def test_a_placed_model_saves_copies_pickles_and_shares():
    m = layers()
    hugepages.place(m)
    values = {k: v.clone() for k, v in m.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    for state in (torch.load(buffer), copy.deepcopy(m).state_dict(), pickle.loads(pickle.dumps(m)).state_dict()):
        assert all(torch.equal(values[k], v) for k, v in state.items())
    m.share_memory()
    assert m[0].weight.is_shared() and torch.equal(m[0].weight, values["0.weight"])


@needs_thp
@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a8"])
def test_a_generate_calls_quantized_copies_are_packed_in_huge_pages_and_decode_the_same(monkeypatch, quantize):
    """The layers' copies and the LM head's, made by a quantized generate call, go into mappings of huge pages (made
    again, and placed again, after a training step changed the weights); the tokens are those of copies left in
    torch's allocations (GPT2_HUGE_PAGES=0)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=512, vocab_size=9000, n_positions=64)).eval()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 9000, (1, 10))
    for step in range(2):
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False, quantize=quantize)
        copies = [layer.__dict__["_quantized_cache"][1].q for layer in model.modules()
                  if "_quantized_cache" in layer.__dict__]
        head = model.gpt.__dict__["_quantized_head"][1].q
        assert len(copies) == 12 and all(thp_eligible(q.data_ptr()) for q in copies + [head])
        monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
        with torch.no_grad():
            assert torch.equal(tokens, twin.generate(ids, max_new_tokens=6, do_sample=False, quantize=quantize))
        twin_copies = [layer.__dict__["_quantized_cache"][1].q for layer in twin.modules()
                       if "_quantized_cache" in layer.__dict__]
        assert not any(thp_eligible(q.data_ptr()) for q in twin_copies)
        monkeypatch.delenv("GPT2_HUGE_PAGES")
        for m in (model, twin):  # the same training step on both: every copy is made again
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(ids)["logits"].square().mean().backward()
            opt.step()
