"""The converter's fast paths give exactly what the slow, plain ways give.

Conversion parses with libcst only the statements a rule's check (``convert/engine/rule.py``) says the rule may
change, and the cleaner rewrites the magic lines IPython writes as text. Both are only worth having if they
change nothing: here every notebook of the corpus, the examples and the templates, and variants of them
(comments everywhere, other indentations, cells run together), are converted both ways and compared.
"""

import random
import re
from pathlib import Path

import libcst as cst
import nbformat
import pytest

from nbddp.cells import Cell, cells_from_sources, read_notebook
from nbddp.convert import clean, convert_cells
from nbddp.convert.clean import clean_cell
from nbddp.convert.code import CellCode
from nbddp.convert.engine import plan
from nbddp.convert.rules.device_map import DeviceMapRule
from nbddp.convert.rules.trainer_config import TrainerConfigRule
from test_script import ODD_CELLS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "tests" / "corpus").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
    (ROOT / "templates").glob("*.ipynb")
)


PLAIN_LOOP = """model = Net().to("cuda:0")
opt = torch.optim.Adam(model.parameters())
train_loader = DataLoader(ds, batch_size=8, shuffle=True)
for epoch in range(2):
    for x, y in train_loader:
        loss = model(x).sum()
        loss.backward()
        print(loss.item())
torch.save(model.state_dict(), "m.pt")
"""


def _sources(path):
    return [c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]


def _commented(source: str, rng: random.Random) -> str:
    """Comments and blank lines between lines, at the indentation around them (or none)."""
    out, lines = [], source.splitlines()
    for i, line in enumerate(lines):
        out.append(line)
        if line.rstrip().endswith("\\") or rng.random() < 0.6:
            continue
        here = re.match(r"\s*", line).group(0)
        nxt = re.match(r"\s*", next((ln for ln in lines[i + 1 :] if ln.strip()), "")).group(0)
        indent = rng.choice([here, nxt, "", here + "    ", None])
        out.append("" if indent is None else f"{indent}# note {i}")
    return "\n".join(out)


def _reindented(source: str, unit: str) -> str:
    return "\n".join(re.sub(r"^((?:    )+)", lambda m: unit * (len(m.group(1)) // 4), ln) for ln in source.splitlines())


def variants():
    """(name, cell sources): each notebook as it is, and rewritten in ways the converter must not mind."""
    rng = random.Random(7)
    for path in NOTEBOOKS:
        code = _sources(path)
        yield path.stem, code
        yield f"{path.stem}-comments", [_commented(c, rng) for c in code]
        yield f"{path.stem}-indent2", [_reindented(c, "  ") for c in code]
        yield f"{path.stem}-tabs", [_reindented(c, "\t") for c in code]
        yield f"{path.stem}-one-cell", ["\n".join(c for c in code if not c.lstrip().startswith("%%"))]
    # odd but valid cells, before and after training (after it, rank 0 guards take them in)
    train = "trainer = Trainer(model=m)\ntrainer.train()\n"
    yield "odd-cells", list(ODD_CELLS)
    yield "odd-cells-around-training", [c for odd in ODD_CELLS for c in (odd, train, odd)]
    yield "odd-cells-plain-loop", [c for odd in ODD_CELLS for c in (odd, PLAIN_LOOP, odd)]


VARIANTS = dict(variants())


def _script(sources, precheck):
    try:
        s = convert_cells(cells_from_sources(sources), origin="nb.ipynb", precheck=precheck)
    except Exception as exc:  # noqa: BLE001 - the same error both ways is the same outcome
        return f"{type(exc).__name__}: {exc}"
    return s.text, s.source_map, s.changes, s.installs, s.warnings


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_checks_change_nothing(name):
    """Only where the checks say vs every statement through libcst: the same script, map and change list."""
    fast, slow = _script(VARIANTS[name], True), _script(VARIANTS[name], False)
    assert fast == slow


def test_the_comparison_catches_a_check_that_misses_its_rule(monkeypatch):
    """A check saying "nothing here" where its rule would change something shows up as a different script."""
    sources = _sources(ROOT / "tests" / "corpus" / "hf_trainer_text_classification.ipynb")
    monkeypatch.setattr(DeviceMapRule, "touches", classmethod(lambda cls, stmt, facts, nodes: False))
    assert _script(sources, True) != _script(sources, False)


def test_only_statements_a_rule_changes_are_parsed_with_libcst(monkeypatch):
    parsed = []
    real = cst.parse_module
    monkeypatch.setattr(cst, "parse_module", lambda code, *a, **k: parsed.append(code) or real(code, *a, **k))
    cells = cells_from_sources([
        "import torch\nfrom transformers import AutoModelForCausalLM, Trainer\nx = 1\n",
        'model = AutoModelForCausalLM.from_pretrained("m")\ny = 2\n',
        "trainer = Trainer(model=model)\ntrainer.train()\n",
        "print('done')\n",
    ])
    script = convert_cells(cells)
    # print('done') only goes under the rank-0 guard: libcst reads a stand-in for it
    assert parsed == ['model = AutoModelForCausalLM.from_pretrained("m")\n', "_nbddp_stands_in_0_\n"]
    assert "device_map=_nbddp.device_map()" in script.text and "if _nbddp.on_rank0():" in script.text


def _magic_cells():
    for path in NOTEBOOKS:
        for cell in read_notebook(path):
            if re.search(r"^\s*[!%]|= *[!%]|get_ipython", cell.source, re.M):
                yield cell
    yield from cells_from_sources([
        "if False:\n    !pip install a\n    %pip install b\nelse:\n    !ls\n# note\n\n%env A=1\nx = !ls\n!!ls\n",
        "%time for i in range(2): print(i)\n%timeit -n1 y = 1\nfiles = !ls {path}\n%pip install $pkg\n%cd ~/x\n",
        "get_ipython().system('ls')  # as written\nget_ipython().system(\"pip install q\")\n"
        "for f in get_ipython().getoutput('ls'):\n    print(f)\n",
        "def f():\n    get_ipython().run_line_magic('env', 'A=1')\n    return get_ipython().getoutput('ls')\n",
        # cells where the escape lines alone are not the whole story (``clean._transform_escape_lines``)
        '\n  \n!ls\ndoc = """\n!not a command\n%not a magic\n"""\nprint("a = %d" % 3)  # why?\n   \nobj?\n',
        "\n  \n!ls\nx = 1\n   \nif x:\n    !echo 1\n    \n    y = 2\n",
        "x = [1\n     ,2]\n!ls\n",
        "    !ls\n    x = 1\n",
        ">>> x = 1\n!ls\n",
        "!ls\n%%time\nx = 1\n",
        "!pip install a \\\n    b\nfor i in range(2):\n    x = !echo {i}\n    %env A=1\n",
        "f = lambda s: s\n!echo %d\nprint('%s' % f('x'))\n",
    ])


#: The cleaner's fast ways, each with what switches it off: the magic lines IPython writes rewritten as
#: text (else libcst), and IPython's transformers on each escape line alone (else on the whole cell).
CLEANER_FAST_WAYS = {"as_text": ("_as_text", lambda *args: None),
                     "escape_lines": ("_transform_escape_lines", lambda body: None)}


@pytest.mark.parametrize("way", sorted(CLEANER_FAST_WAYS))
@pytest.mark.parametrize("cell", list(_magic_cells()), ids=lambda c: c.source[:30])
def test_the_cleaners_fast_ways_clean_as_the_plain_ones(cell, way, monkeypatch):
    def cleaned():
        try:
            return clean_cell(cell)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    fast = cleaned()
    monkeypatch.setattr(clean, *CLEANER_FAST_WAYS[way])
    assert fast == cleaned()


def test_cells_read_with_ast_are_what_libcst_reads():
    """Statements grouped by line and the indentation a new block takes, as libcst sees them."""
    for name, sources in VARIANTS.items():
        for source in sources:
            code = clean_cell(Cell(1, source)).code
            module = cst.parse_module(code)
            cell = CellCode.read(code)
            assert len(cell.statements) == len(module.body), (name, code)
            assert cell.default_indent == module.default_indent, (name, code)


def test_most_magic_cells_take_the_line_by_line_way():
    """The line-by-line way is taken (not refused for every cell), and refused where a line needs the cell."""
    taken = [clean._transform_escape_lines(c.source.splitlines()) is not None for c in _magic_cells()
             if not c.source.lstrip().startswith("%%")]
    assert sum(taken) >= 0.8 * len(taken)
    for refused in ('doc = """\n!not a command\n"""\n!ls\n', "    !ls\n", ">>> x = 1\n!ls\n", "!ls\n%%time\n"):
        assert clean._transform_escape_lines(refused.splitlines()) is None


#: Statements after training that only go under the rank-0 guard, written in the ways whose lines libcst
#: indents differently: multi-line strings, backslashes, comments and blank lines inside brackets, f-strings.
STOOD_IN = [
    'print(f(a,\n         b))  # c\n',
    'print(1 \\\n    + 2)\n',
    'print("""\nab\n  cd\n""")\n',
    'print(\n\n    # comment\n    1,\n)\n',
    'print("a"\n      "b"); print(2)\n',
    'print(f"""x\n{y}\n""")\n',
    "print(f'''{a\n}''')\n",
    'print("a\\\nb")\n',
    'print(1); \\\nprint(2)\n',
    'print(1,\n# at col0\n  2)\n',
    'print(1,\n\t2)  # c \\\nprint(3)\n',
    'print(1,  # c \\\n      2)\n',
    'print("""a \\\nb""")\n',
    "model.save_pretrained('''out\n''', x=r'\\\n')\n",
]


@pytest.mark.parametrize("indent", ["    ", "  ", "\t"])
def test_statements_stood_in_come_back_as_libcst_indents_them(indent, monkeypatch):
    """libcst reads a one-line stand-in for a statement only moved into a block; the script is the same."""
    train = f"trainer = Trainer(model=m)\nif x:\n{indent}trainer.train()\n"
    sources = [train] + STOOD_IN
    stood_in = []
    real = plan.plan_cell
    from nbddp.convert import script as script_module

    monkeypatch.setattr(script_module, "plan_cell",
                        lambda *a, **k: (p := real(*a, **k)) and stood_in.extend(p.stand_ins) or p)
    fast = _script(sources, True)
    assert len(stood_in) >= len(STOOD_IN) - 2  # all but the multi-line f-strings
    assert fast == _script(sources, False)
    assert fast[0].count("if _nbddp.on_rank0():") == len(STOOD_IN)


def test_a_change_found_by_position_below_stand_ins_is_at_its_line(monkeypatch):
    """Where a change is located by libcst's positions (a nested call over lines, written with tabs), the
    statement stand-ins above it count as the lines they stand for."""
    from nbddp.convert.engine import rewrite

    positions = []
    real = rewrite.MetadataWrapper
    monkeypatch.setattr(rewrite, "MetadataWrapper", lambda *a, **k: positions.append(1) or real(*a, **k))
    sources = [
        "trainer = Trainer(model=m)\ntrainer.train()\n",
        'print("saving")\nprint(\n\t"more")\nif True:\n\tm = AutoModelForCausalLM.from_pretrained(\n\t\tname, torch_dtype=x)\n',
    ]
    fast = _script(sources, True)
    assert positions  # the located-by-position way was taken
    assert fast == _script(sources, False)
    assert any(c.rule == "device_map" and (c.cell, c.line) == (2, 5) for c in fast[2])


#: Calls with many arguments, where the ones a rule reads sit anywhere among those it does not, and loops
#: where what a rule changes sits deep among statements it leaves alone.
MANY_ARGUMENTS = [
    "args = TrainingArguments(\n    output_dir='o',  # where\n    per_device_train_batch_size=2,\n"
    "    gradient_checkpointing=True,\n    learning_rate=2e-4,\n    lr_scheduler_type='cosine',\n"
    "    ddp_find_unused_parameters=True,\n    warmup_steps=5, max_steps=60,\n    logging_steps=1,\n"
    "    optim={'name': 'adamw',\n           'fused': True},\n    report_to='none',\n)\n",
    "cfg = SFTConfig(output_dir='o', max_steps=3, report_to='none', bf16=False, seed=3407, optim='adamw_8bit')\n",
    "model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16, trust_remote_code=True,\n"
    "    attn_implementation='sdpa', low_cpu_mem_usage=True, revision='main', device_map='cuda:0')\n",
    "trainer = SFTTrainer(model=model, tokenizer=tok, train_dataset=ds, dataset_text_field='text',\n"
    "    max_seq_length=2048, args=SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4,\n"
    "    warmup_steps=5, max_steps=60, learning_rate=2e-4, logging_steps=1, **extra), packing=False)\n",
    "for epoch in range(3):\n    model.train()\n    # comment\n\n    for x, y in loader:\n"
    "        def f(a):\n            return a\n        x = x.to('cuda')\n        with torch.cuda.amp.autocast(True, torch.float16):\n"
    "            loss = f(model(x)).sum()\n        if False:\n            pass\n        loss.backward()  # go\n"
    "    else:\n        print('done')\n",
    "try:\n    m = AutoModel.from_pretrained(n)\n    print(m)\nexcept Exception:\n    m = None\n    print('no')\n",
    "print(AutoModelForCausalLM.from_pretrained(n, torch_dtype=x, low_cpu_mem_usage=True,\n"
    "    revision='main', trust_remote_code=True,\n    attn_implementation='sdpa', cache_dir='c', token=t))\n",
]


def _parsed(monkeypatch, sources, precheck=True):
    parsed = []
    real = cst.parse_module
    monkeypatch.setattr(cst, "parse_module", lambda code, *a, **k: parsed.append(code) or real(code, *a, **k))
    script = _script(sources, precheck)
    monkeypatch.setattr(cst, "parse_module", real)
    return script, "".join(parsed)


@pytest.mark.parametrize("after_training", [False, True])
def test_arguments_and_inner_statements_no_rule_reads_stand_in(after_training, monkeypatch):
    """libcst reads stand-ins for the arguments and the statements inside blocks that no rule reads; the
    script is the same (after training a statement rule moves these statements, and runs stay on a line)."""
    sources = (["trainer = Trainer(model=m)\ntrainer.train()\n"] if after_training else []) + MANY_ARGUMENTS
    for indent in ("    ", "\t"):
        cells = [c.replace("    ", indent) for c in sources]
        fast, parsed = _parsed(monkeypatch, cells)
        assert "_nbddp_arg_" in parsed and "_nbddp_stands_in_" in parsed
        assert "per_device_train_batch_size" not in parsed and "lr_scheduler_type" not in parsed
        assert fast == _script(cells, False)


def test_the_comparison_catches_a_rule_reading_a_keyword_its_check_does_not_list(monkeypatch):
    """A keyword the rule reads but its check leaves out stands in, and the script differs."""
    sources = ["model = get_peft_model(model, config)\n"] + MANY_ARGUMENTS[:1]  # PEFT: the rule reads ddp_find_unused_parameters
    monkeypatch.setattr(TrainerConfigRule, "keywords", frozenset({"log_on_each_node", "gradient_checkpointing_kwargs",
                                                                     "gradient_checkpointing"}))
    assert _script(sources, True) != _script(sources, False)
