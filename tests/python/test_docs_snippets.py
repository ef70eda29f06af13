"""The ```python blocks of README.md and docs/*.md, run as a user pastes them, on this CPU.

Each block runs statement by statement in a namespace holding what it takes for granted
(`model`, `x`, a data set): the smallest fill-in a user would write. What only a GPU has is
changed, always the same way (for_cpu): `.cuda()` is dropped, "cuda" devices become "cpu" and
`dist.init_process_group("nccl")` is skipped (the test's gloo group is up); paths under /nvme*
go to a temporary folder; a placeholder line (`gs = ...`) keeps the fill-in. The ZeRO and
Hugging Face blocks run on 2 gloo ranks in one spawn, each rank its own node (GROUP_RANK), the
rest in this process. Where a comment says what a call returns, the test checks it, and blocks
that compute something are compared with plain PyTorch. A block added to the docs fails
test_every_block_has_a_case until it gets one here."""

from __future__ import annotations

import ast
import os
import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierlift

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Where a GPU is assumed, and what runs instead on this CPU.
_CUDA_ONLY = (
    ('dist.init_process_group("nccl")', "pass  # CUDA-only: the test's gloo group is up"),
    (".cuda()", ""),
    ('"cuda"', '"cpu"'),
)


def blocks(rel: str) -> list[str]:
    return _FENCE.findall((ROOT / rel).read_text())


def readme_sections() -> list[str]:
    """The README's block is a tour: paragraphs that do not depend on each other."""
    return [s for s in blocks("README.md")[0].split("\n\n") if s.strip()]


def on_ranks(section: str) -> bool:
    return re.search(r"tierlift\.(zero|hf)\.", section) is not None


def for_cpu(src: str, tmp: str) -> str:
    for gpu, cpu in _CUDA_ONLY:
        src = src.replace(gpu, cpu)
    return re.sub(r'"/nvme(\d?)', lambda m: f'"{tmp}/nvme{m.group(1)}', src)


def nvme_dirs(tmp: str) -> None:
    for d in ("nvme/swap", "nvme0/swap", "nvme1"):
        os.makedirs(os.path.join(tmp, d), exist_ok=True)


class _Placeholders(ast.NodeTransformer):
    """`f(lr=...)`: the user's value, here the namespace's `lr`."""

    def visit_keyword(self, node: ast.keyword) -> ast.keyword:
        if isinstance(node.value, ast.Constant) and node.value.value is Ellipsis and node.arg:
            node.value = ast.copy_location(ast.Name(node.arg, ast.Load()), node.value)
        return self.generic_visit(node)


def run(src: str, ns: dict, before=(), after=()) -> dict:
    """Runs `src` one top-level statement at a time in `ns`; `before`/`after`: (text, fn(ns))
    called around each statement containing the text, each at least once (one that never runs
    checks nothing). An expression's value is ns["_"]."""
    src = for_cpu(src, ns["tmp"])
    fired = set()
    for stmt in ast.parse(src).body:
        stmt = ast.fix_missing_locations(_Placeholders().visit(stmt))
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                and stmt.value.value is Ellipsis):
            continue  # `name = ...`: the user's own, here the fill-in
        text = ast.get_source_segment(src, stmt)
        for needle, fn in before:
            if needle in text:
                fn(ns)
                fired.add(needle)
        if isinstance(stmt, ast.Expr):
            ns["_"] = eval(compile(ast.Expression(stmt.value), "<snippet>", "eval"), ns)
        else:
            exec(compile(ast.Module([stmt], type_ignores=[]), "<snippet>", "exec"), ns)
        for needle, fn in after:
            if needle in text:
                fn(ns)
                fired.add(needle)
    assert fired == {needle for needle, _ in (*before, *after)}, f"no statement has {fired}"
    return ns


def present(hooks, src: str) -> list:
    """The hooks for statements `src` has (a README section has some of them)."""
    return [(needle, fn) for needle, fn in hooks if needle in src]


# ---- fill-ins ----
class Blocks(nn.Module):
    """A stack of blocks in an nn.ModuleList (what offload_blocks looks for)."""

    def __init__(self, n: int = 24, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(n))

    def forward(self, x, y=None):
        for b in self.blocks:
            x = b(x)
        return x.square().mean() if y is None else F.mse_loss(x, y)


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(61, 16), nn.Linear(16, 61)

    def forward(self, idx):
        return self.head(self.embed(idx))


def wide() -> nn.Module:
    """Layers convert() takes with its defaults (multiples of 16, at least 1024 wide)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))


def small_converted() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    tierlift.lowp.convert(model, recipe="fp8-rowwise", min_features=16)
    return model


def namespace(tmp, **names) -> dict:
    nvme_dirs(str(tmp))
    return {"tmp": str(tmp), "torch": torch, "tierlift": tierlift, **names}


def train_step(model, opt, x) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


# ---- blocks run in this process ----
@pytest.mark.parametrize("i", [i for i, s in enumerate(readme_sections()) if not on_ranks(s)])
def test_readme_section(i, tmp_path, monkeypatch, one_thread):
    import torch_geometric.loader
    from torch_geometric.testing import MyGraphStore

    monkeypatch.chdir(tmp_path)
    features, deg = torch.randn(100, 8), torch.randint(1, 10, (100,))
    graph_store = MyGraphStore()
    graph_store.put_edge_index(torch.randint(0, 100, (2, 400)), edge_type=None, layout="coo",
                               size=(100, 100))
    ns = namespace(tmp_path, model=Blocks(4), features=features, deg=deg,
                   batch_nodes=torch.randint(0, 100, (10,)), graph_store=graph_store,
                   train_idx=torch.arange(20), torch_geometric=torch_geometric,
                   tensor=torch.randn(1000))

    def stepped(ns):  # a step first, then the per-step breakdown is read
        train_step(ns["model"], ns["opt"], torch.randn(4, 32))

    def breakdown(ns):
        assert any(k.endswith("_s") for k in ns["_"]) and ns["_"]["nvme_write_bytes"] > 0

    def batch_read(ns):
        batch = next(iter(ns["loader"]))
        assert torch.equal(batch.x, features[batch.n_id])

    sec = readme_sections()[i]
    run(sec, ns, before=present([("opt.last_step_stats", stepped)], sec),
        after=present([("opt.last_step_stats", breakdown), ("loader =", batch_read)], sec))
    if "x" in ns and "store" in ns:
        assert torch.equal(ns["x"], features[ns["batch_nodes"]])
    if "swap" in ns:
        assert torch.equal(ns["tensor"], ns["swap"].get("layer0.exp_avg"))


def test_activations(tmp_path, one_thread):
    model = Blocks(24, 512)
    x, y = torch.randn(520, 512), torch.randn(520, 512)  # saved tensors just above min_bytes
    model(x, y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    seen, stats = [], {}

    def grads_as_plain(ns):  # read back bit for bit
        assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
        model.zero_grad()
        seen.append(1)

    ns = run(blocks("docs/activations.md")[0], namespace(tmp_path, model=model, x=x, y=y),
             after=[("loss.backward()", grads_as_plain), ("model(x, y).backward()",
                                                          grads_as_plain),
                    ("handle.last_stats", lambda ns: stats.update(ns["_"]))])
    assert len(seen) == 2
    assert stats["ram_bytes"] > 0  # "auto" in a budget that holds them all: RAM
    assert {"kept_bytes", "nvme_bytes", "read_wait_s", "write_wait_s", "reads_ahead",
            "reads_on_demand"} <= stats.keys()
    model(x, y).backward()  # the last handle: one tier per block of the 24
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    stats = ns["handle"].last_stats
    assert stats["nvme_bytes"] > 0 and stats["ram_bytes"] > 0 and stats["reads_ahead"] > 0
    ns["handle"].remove()


def test_gnn(tmp_path):
    n = 2100  # two batches of the page's 1024 seeds
    x, deg = torch.randn(n, 16), torch.randint(1, 20, (n,))
    ids = torch.randint(0, n, (64,))
    ns = run(blocks("docs/gnn.md")[0], namespace(tmp_path, x=x, deg=deg, node_ids=ids,
                                                 buf=torch.empty(64, 16), side_stream=None))
    assert torch.equal(ns["h"], x[ids]) and torch.equal(ns["buf"], x[ids])

    from torch_geometric.testing import MyGraphStore

    gs = MyGraphStore()
    gs.put_edge_index(torch.randint(0, n, (2, 8 * n)), edge_type=None, layout="coo",
                      size=(n, n))
    batches = []

    def model(feats, edge_index):  # counts the batches the loop ran
        batches.append(feats.shape[0])
        return feats

    run(blocks("docs/gnn.md")[1], namespace(tmp_path, x=x, deg=deg, gs=gs, epochs=1,
                                            train_ids=torch.arange(2048), model=model),
        after=[("batch.x", lambda ns: torch.testing.assert_close(  # the comment's claim
            ns["batch"].x, x[ns["batch"].n_id], rtol=0, atol=0))])
    assert len(batches) == 2


def test_io(tmp_path):
    ns = run(blocks("docs/io.md")[0], namespace(tmp_path))
    assert torch.equal(ns["m"], ns["t"])
    assert ns["buf"].data_ptr() % 4096 == 0 and ns["buf"].numel() == 64 << 20


@pytest.mark.parametrize("i", [0, 2])
def test_lowp(i, tmp_path):
    ns = run(blocks("docs/lowp.md")[i], namespace(tmp_path, model=wide()))
    kind = tierlift.lowp.Float8Linear if i == 0 else tierlift.lowp.FP4Linear
    names = [n for n, m in ns["model"].named_modules() if isinstance(m, kind)]
    assert names == ns["report"].converted == ["0", "2"]


def test_offload_checkpoints(tmp_path, monkeypatch, one_thread):
    from tierlift.checkpoint.__main__ import main

    monkeypatch.chdir(tmp_path)
    nvme_dirs(str(tmp_path))
    model = Blocks(2)
    opt = tierlift.optim.AdamW(model.parameters(), offload="nvme", nvme_path=str(tmp_path / "nvme"))
    train_step(model, opt, torch.randn(4, 32))
    ns = run(blocks("docs/offload-checkpoints.md")[0],
             namespace(tmp_path, model=model, opt=opt, step=7, losses=[2.5, 2.0]))
    assert ns["extra"] == {"step": 7, "losses": [2.5, 2.0]}
    # the export command next to it (a bash block): torch's AdamW takes what it writes
    assert main(["export-optimizer", "ckpt/latest", "optim.pt"]) == 0
    plain = torch.optim.AdamW(model.parameters())
    plain.load_state_dict(torch.load("optim.pt"))
    ours = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(plain.state[p]["exp_avg_sq"], ours[i]["exp_avg_sq"])


def test_offload_durable(tmp_path, one_thread):
    ns = run(blocks("docs/offload-durable.md")[0], namespace(tmp_path, model=Blocks(2)))
    train_step(ns["model"], ns["opt"], torch.randn(4, 32))
    assert ns["opt"].state_dict()["state"][0]["step"] == 1


def test_offload_page(tmp_path, one_thread):
    model = Blocks(2)
    ns = run(blocks("docs/offload.md")[0], namespace(
        tmp_path, model=model, loss=model(torch.randn(4, 32))))
    stats = ns["opt"].last_step_stats
    assert {"cpu_step_s", "nvme_read_wait_s", "nvme_write_wait_s", "checksum_s"} <= stats.keys()
    assert all({"total_s", "exposed_s"} <= leg.keys() for leg in stats["legs"].values())


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_grad_scaler_recipes_as_torch(offload, tmp_path, one_thread):
    """Both recipes, run with tierlift's AdamW and with torch's: the same weights."""
    recipes = blocks("docs/optim.md")[0].split("\n\n")
    assert len(recipes) == 2
    x = torch.randn(8, 32)
    for recipe in recipes:
        out = []
        for make in (lambda ps: tierlift.optim.AdamW(ps, lr=1e-2, offload=offload),
                     lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
            model = Blocks(2)
            ns = namespace(tmp_path, model=model, opt=make(model.parameters()),
                           scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
            for _ in range(3):
                ns["loss"] = model(x)
                run(recipe, ns)
                ns["opt"].zero_grad()
            out.append(list(model.parameters()))
        for a, b in zip(*out):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---- blocks run on 2 gloo ranks (one spawn) ----
def _llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32,
        tie_word_embeddings=tied))


def _hf_args(out: str, **extra):
    from hf_worker import training_args

    kw = {"max_steps": 2, "save_steps": 2, "max_grad_norm": 1.0, "logging_steps": 100}
    return training_args(out, batch=2, **{**kw, **extra})


def _rank_cases(rank: int, world: int, tmp: str) -> dict:
    """Every ranked block; each case's error as text (the others still run)."""
    results: dict = {}
    try:
        _ranked_blocks(rank, world, tmp, results)
    except Exception:  # outside a block: every test says so
        results["setup"] = traceback.format_exc()
    return results


def _ranked_blocks(rank: int, world: int, tmp: str, results: dict) -> None:
    from hf_worker import Data, quiet
    from zero_model import SEQ, VOCAB, make_model

    # No `import tierlift.hf` before the README's own: its tour starts from `import tierlift`.
    # As torchrun with one rank per node would set them (the process group is up already).
    os.environ.update(GROUP_RANK=str(rank), RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    quiet()
    dist = torch.distributed
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))

    def fresh(make):
        return lambda ns: ns.update(model=make())

    def step(ns, x=tokens):
        opt = ns.get("opt") or tierlift.optim.AdamW(ns["model"].parameters())
        train_step(ns["model"], opt, x)

    def folder(name):  # each block in a folder of its own, the same on both ranks
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        os.chdir(path)
        return path

    def case(name, src, before=(), after=(), **names):
        try:
            ns = run(src, namespace(folder(name), dist=dist, **names), before, after)
            results[name] = ns.pop("result", "ok")
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()

    def pretrained(name):  # ./llama: a Hugging Face folder with tied embeddings
        if rank == 0:
            _llama(tied=True).save_pretrained(os.path.join(folder(name), "llama"))
        dist.barrier()

    # README
    def norms_agree(ns):  # "torch.nn.utils.clip_grad_norm_ too": the same global norm
        ns["model"](tokens).square().mean().backward()
        ns["torch_norm"] = torch.nn.utils.clip_grad_norm_(ns["model"].parameters(), 1e9)

    def prepared(ns):  # Accelerate: shard, build the optimizer on the shards
        ns["model"] = tierlift.zero.shard(_llama(), stage=3)
        ns["opt"] = tierlift.optim.AdamW(ns["model"].parameters())

    def comm_stats(ns):
        stats = ns["_"]
        ns["result"] = (set(stats), stats["inter_node_bytes"] > 0)

    sections = [s for s in readme_sections() if on_ranks(s)]
    for i, sec in enumerate(sections):
        if "tierlift.hf." in sec:
            case(f"readme{i}", sec, before=[("Accelerator().prepare", prepared)],
                 model=_llama(), args=_hf_args(os.path.join(tmp, "readme_hf")), data=Data())
        elif "lowp.convert" in sec:
            case(f"readme{i}", sec, model=wide())
        else:
            case(f"readme{i}", sec,
                 before=present([("zero.shard(model", fresh(make_model)),
                                 ("clip_grad_norm_", norms_agree),
                                 ("last_step_stats", lambda ns: step(ns))], sec),
                 after=present([("clip_grad_norm_", lambda ns: torch.testing.assert_close(
                     ns["_"], ns["torch_norm"])),
                                ("checkpoint.load", lambda ns: ns.update(result=ns["extra"])),
                                ("last_step_stats", comm_stats)], sec))

    # docs
    def bf16_step(ns):
        ns["model"](torch.randn(4, 1024, dtype=torch.bfloat16)).float().sum().backward()

    case("lowp", blocks("docs/lowp.md")[1], after=[("fp8_all_gather", bf16_step)], model=wide())
    for page in ("offload-params-nvme", "offload-zero-infinity"):
        case(page, blocks(f"docs/{page}.md")[0],
             after=[("opt = ", lambda ns: step(ns))], model=make_model(),
             loss_fn=lambda out: out.float().square().mean(), batch=tokens)
    model = tierlift.zero.shard(make_model(), stage=3)
    opt = tierlift.optim.AdamW(model.parameters())
    step({"model": model, "opt": opt})

    def saved(ns):
        assert ns["h"].done()
        ns["result"] = tierlift.checkpoint.load("ckpt/step200", model, opt)

    case("zero-checkpoints", blocks("docs/zero-checkpoints.md")[0], after=[("h.wait()", saved)],
         model=model, opt=opt)

    def pad_row(ns):
        ns["result"] = tierlift.zero.full_state_dict(ns["model"])["embed.weight"][3].abs().sum()

    case("zero-guard-rails", blocks("docs/zero-guard-rails.md")[0],
         after=[("modifier_rank=0", pad_row)],
         model=tierlift.zero.shard(Embedded(), stage=3), pad_id=3)

    def checkpoint_first(ns):  # resume_from_checkpoint=True needs one: an earlier run's
        args = _hf_args(ns["trainer"].args.output_dir)
        tierlift.hf.Trainer(model=_llama(), args=args, train_dataset=ns["data"],
                            zero=ns["trainer"].zero).train()

    def loads_back(ns):  # save_model("out") -> from_pretrained("out"): the trained weights
        from transformers import AutoModelForCausalLM

        full = tierlift.zero.full_state_dict(ns["trainer"].model)
        dist.barrier()  # rank 0 wrote "out"
        back = AutoModelForCausalLM.from_pretrained("out").state_dict()
        assert all(torch.equal(back[k], v) for k, v in full.items())

    def hf_loader(ns):
        ns["loader"] = torch.utils.data.DataLoader(ns["data"], batch_size=2)
        ns["sched"] = torch.optim.lr_scheduler.LambdaLR(ns["opt"], lambda s: 1.0)

    def hf_loop(ns):  # "the usual loop"
        acc, model, opt = ns["accelerator"], ns["model"], ns["opt"]
        for _, batch in zip(range(4), ns["loader"]):
            with acc.accumulate(model):
                acc.backward(model(**batch).loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                ns["sched"].step()
                opt.zero_grad()

    pretrained("zero-hugging-face0")
    pretrained("zero-meta-device")
    hf_pages = blocks("docs/zero-hugging-face.md")
    case("zero-hugging-face0", hf_pages[0], data=Data(),
         training_args=_hf_args(os.path.join(tmp, "zero-hugging-face0", "out")))
    case("zero-hugging-face1", hf_pages[1],
         before=[("resume_from_checkpoint", checkpoint_first),
                 ("zero.shard(model", fresh(_llama)), ("accelerator.prepare", hf_loader)],
         after=[("save_model", loads_back), ("accelerator.prepare", hf_loop)],
         model=_llama(), data=Data(),
         training_args=_hf_args(os.path.join(tmp, "zero-hugging-face1", "run"), max_steps=3))

    def same_as_pretrained(ns):
        from transformers import AutoModelForCausalLM

        want = AutoModelForCausalLM.from_pretrained("llama")(input_ids=tokens).logits
        ns["result"] = float((ns["model"](input_ids=tokens).logits - want).abs().max())

    import accelerate
    from transformers import AutoConfig, AutoModelForCausalLM

    case("zero-meta-device", blocks("docs/zero-meta-device.md")[0],
         after=[('weights="llama/")', same_as_pretrained)],
         Llama=lambda cfg: make_model(), cfg=None,
         accelerate=accelerate, AutoModelForCausalLM=AutoModelForCausalLM,
         config=AutoConfig.from_pretrained(os.path.join(tmp, "zero-meta-device", "llama")))

    case("zero-multi-node", blocks("docs/zero-multi-node.md")[0],
         before=[("last_step_stats", lambda ns: step(ns, torch.randn(4, 32)))],
         after=[("last_step_stats", comm_stats)], model=small_converted())

    def groups(ns):
        ns["result"] = [(len(g["params"]), g["weight_decay"]) for g in ns["opt"].param_groups]
        step(ns)

    def get_default_optimizer_params(model, *_):  # as detectron2's: one group per parameter
        return [{"params": [p], "lr": 2e-3 if n.endswith("bias") else 1e-3,
                 "weight_decay": 0.0 if p.dim() < 2 else 0.1}
                for n, p in model.named_parameters() if p.requires_grad]

    def settings(ns):  # the framework's groups, one per parameter here, kept
        want = get_default_optimizer_params(make_model())
        got = [(g["lr"], g["weight_decay"]) for g in ns["opt"].param_groups]
        ns["result"] = (len(got) == len(want), sorted(set(got)))
        step(ns)

    group_pages = blocks("docs/zero-optimizer-groups.md")
    case("zero-optimizer-groups0", group_pages[0], after=[("param_groups(", groups)],
         model=make_model())
    case("zero-optimizer-groups1", group_pages[1], after=[("param_groups(", settings)],
         model=make_model(), lr=1e-3, get_default_optimizer_params=get_default_optimizer_params)

    def full(ns):
        ns["result"] = {k: v.shape for k, v in ns["sd"].items()}

    case("zero", blocks("docs/zero.md")[0], after=[("full_state_dict", full)], model=make_model(),
         loss_fn=lambda out: out.float().square().mean(), micro_batches=list(tokens.chunk(2)))


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    from zero_model import spawn_ranks

    return spawn_ranks(_rank_cases, str(tmp_path_factory.mktemp("ranks")))


def _ok(ranked, name):
    for r, out in enumerate(ranked):
        assert "setup" not in out, f"rank {r}:\n{out['setup']}"
        got = out[name]
        assert not (isinstance(got, str) and "Traceback" in got), f"rank {r}:\n{got}"
    return [out[name] for out in ranked]


@pytest.mark.parametrize("i", range(sum(on_ranks(s) for s in readme_sections())))
def test_readme_ranked_section(i, ranked):
    sec, got = [s for s in readme_sections() if on_ranks(s)][i], _ok(ranked, f"readme{i}")
    if "last_step_stats" in sec:  # "bytes sent inside the node and across"
        assert got == [_COMM_STATS] * 2
    elif "checkpoint.load" in sec:
        assert got == [{"step": 100}] * 2
    else:
        assert got == ["ok", "ok"]


@pytest.mark.parametrize("name", ["lowp", "offload-params-nvme", "offload-zero-infinity",
                                  "zero-hugging-face0", "zero-hugging-face1"])
def test_ranked_block_runs(name, ranked):
    _ok(ranked, name)


def _full_shapes():
    from zero_model import make_model

    return {k: v.shape for k, v in make_model().state_dict().items()}


_COMM_STATS = ({"intra_node_bytes", "inter_node_bytes"}, True)  # keys, bytes across nodes > 0


_RESULTS = [
    ("zero-checkpoints", lambda: [{"step": 200}] * 2),
    ("zero-guard-rails", lambda: [0.0, 0.0]),  # rank 0's edit of the pad row, on every rank
    ("zero-meta-device", lambda: [0.0, 0.0]),  # the pretrained model's logits, exactly
    ("zero-multi-node", lambda: [_COMM_STATS] * 2),
    ("zero-optimizer-groups0", lambda: [[(4, 0.1), (4, 0.0)]] * 2),
    ("zero-optimizer-groups1", lambda: [(True, [(1e-3, 0.0), (1e-3, 0.1), (2e-3, 0.0)])] * 2),
    ("zero", lambda: [_full_shapes()] * 2),  # unsharded, on every rank
]


@pytest.mark.parametrize("name, want", _RESULTS, ids=[name for name, _ in _RESULTS])
def test_ranked_block_results(name, want, ranked):
    got = _ok(ranked, name)
    got = [float(v) if isinstance(v, torch.Tensor) else v for v in got]
    assert got == want()


def test_hf_blocks_import_it():
    """`import tierlift` leaves tierlift.hf out (it needs transformers and accelerate); the spawn
    cannot show that once one block imported it, so each block that uses it must say so."""
    pages = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    using = [(p, i) for p in pages for i, b in enumerate(blocks(p)) if "tierlift.hf." in b]
    assert using, "no block uses tierlift.hf"
    assert [(p, i) for p, i in using if "import tierlift.hf" not in blocks(p)[i]] == []


# Blocks per file that the cases above run; a new block needs a case.
_CASES = {
    "README.md": 1, "docs/activations.md": 1, "docs/gnn.md": 2, "docs/io.md": 1,
    "docs/lowp.md": 3, "docs/offload-checkpoints.md": 1, "docs/offload-durable.md": 1,
    "docs/offload-params-nvme.md": 1, "docs/offload-zero-infinity.md": 1, "docs/offload.md": 1,
    "docs/optim.md": 1, "docs/zero-checkpoints.md": 1, "docs/zero-guard-rails.md": 1,
    "docs/zero-hugging-face.md": 2, "docs/zero-meta-device.md": 1, "docs/zero-multi-node.md": 1,
    "docs/zero-optimizer-groups.md": 2, "docs/zero.md": 1,
}


def test_every_block_has_a_case():
    pages = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    found = {p: len(blocks(p)) for p in pages if blocks(p)}
    assert found == _CASES
