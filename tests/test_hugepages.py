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
    assert hugepages.pack([t])[0] is t


@needs_thp
def test_one_tensor_packed_keeps_its_values_in_an_eligible_mapping():
    t = torch.randn(1024, 1024)
    c = hugepages.pack([t])[0]
    assert c is not t and torch.equal(c, t) and c.stride() == t.stride() and thp_eligible(c.data_ptr())
    small = torch.randn(10)
    assert hugepages.pack([small])[0] is small  # less than a huge page: itself


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
        kept = [layer.__dict__["_quantized_cache"][1] for layer in model.modules()
                if "_quantized_cache" in layer.__dict__]
        copies = [entry.q for entry in kept]
        head = model.gpt.__dict__["_quantized_head"][1].q
        assert len(copies) == 12 and all(thp_eligible(q.data_ptr()) for q in copies + [head])
        assert all(thp_eligible(entry.scale.data_ptr()) for entry in kept)  # the scales beside their weights
        with torch.no_grad():  # nothing changed: the next call reads the same copies, not a new packing of them
            model.generate(ids, max_new_tokens=2, do_sample=False, quantize=quantize)
        assert [layer.__dict__["_quantized_cache"][1].q.data_ptr() for layer in model.modules()
                if "_quantized_cache" in layer.__dict__] == [q.data_ptr() for q in copies]
        assert model.gpt.__dict__["_quantized_head"][1].q.data_ptr() == head.data_ptr()
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
    first = model.gpt.gpt_layers[0].self_attention.query
    with torch.no_grad():  # one layer's weight changed, the first of the call's copies: all are packed again
        model.generate(ids, max_new_tokens=2, do_sample=False, quantize=quantize)  # copies of the trained weights
        old = first.__dict__["_quantized_cache"][1].q
        first.weight.mul_(1.5)
        model.generate(ids, max_new_tokens=2, do_sample=False, quantize=quantize)
    new = first.__dict__["_quantized_cache"][1].q
    assert new.data_ptr() != old.data_ptr() and thp_eligible(new.data_ptr())


@pytest.mark.parametrize("text, mode, usable", [("always [madvise] never\n", "madvise", True),
                                                 ("[always] madvise never\n", "always", True),
                                                 ("always madvise [never]\n", "never", False),
                                                 ("garbled\n", "", False), (None, "", False)])
def test_the_thp_mode_is_read_from_sysfs_and_decides_availability(tmp_path, monkeypatch, text, mode, usable):
    path = tmp_path / "enabled"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(hugepages, "THP_MODE", path)
    monkeypatch.delenv("GPT2_HUGE_PAGES", raising=False)
    assert hugepages.mode() == mode and hugepages.available() == (usable and hasattr(hugepages.mmap, "MADV_HUGEPAGE")
                                                                  and hugepages.sys.platform == "linux")
    monkeypatch.setenv("GPT2_HUGE_PAGES", "0")
    assert not hugepages.available()


def test_huge_bytes_reads_anon_huge_pages(tmp_path, monkeypatch):
    smaps = tmp_path / "smaps_rollup"
    smaps.write_text("Rss:  900 kB\nAnonHugePages:    4096 kB\nShmemHugePages: 0 kB\n")
    monkeypatch.setattr(hugepages, "SMAPS", smaps)
    assert hugepages.huge_bytes() == 4096 * 1024
    smaps.write_text("Rss:  900 kB\n")
    assert hugepages.huge_bytes() == 0
    monkeypatch.setattr(hugepages, "SMAPS", tmp_path / "missing")
    assert hugepages.huge_bytes() == 0


@needs_thp
def test_pack_leaves_what_it_cannot_move_and_aligns_the_rest():
    big = torch.randn(512, 1024)  # exactly one huge page of values: enough on its own
    overlapping = torch.zeros(1).expand(4096)  # a tensor whose elements share memory: not moved
    one = torch.tensor([3.5])
    packed = hugepages.pack([overlapping, big, one])
    assert packed[0] is overlapping and packed[1] is not big and packed[2] is not one
    assert torch.equal(packed[1], big) and torch.equal(packed[2], one)
    assert packed[1].data_ptr() % hugepages.HUGE == 0 and packed[2].data_ptr() == packed[1].data_ptr() + big.nbytes
    small = [torch.randn(1000), torch.randn(1000)]
    assert all(a is b for a, b in zip(hugepages.pack(small), small))  # less than a huge page in all
    m = torch.nn.Module()
    m.w, m.s = torch.nn.Parameter(torch.randn(512, 1024)), torch.nn.Parameter(torch.tensor([2.0]))
    assert hugepages.place(m) == big.nbytes + 64 and m.s.data_ptr() == m.w.data_ptr() + big.nbytes
    assert m.s.item() == 2.0


@needs_thp
def test_exactly_one_huge_page_of_values_is_enough_and_an_arena_is_as_long_as_asked():
    page = torch.randn(512, 1024)  # 2 MiB
    assert hugepages.pack([page])[0] is not page
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(page.clone())
    assert hugepages.place(m) == hugepages.HUGE and torch.equal(m.w, page)
    block = hugepages.arena(3 << 20)
    assert block.numel() == 3 << 20 and block.data_ptr() % hugepages.HUGE == 0 and not block.any()
