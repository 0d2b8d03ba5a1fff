"""The user docs hold what they say: links resolve, named commands exist, the README's code runs.

Pages: README.md, CHANGELOG.md and docs/*.md (the raw run files under docs/results/ and
docs/search/ are records, not pages). The README's quickstart runs on a tiny random model with
the same calls (``load_demo`` replaced), and on the real demo model among the slow tests.
"""

from __future__ import annotations

import contextlib
import io
import re
import unicodedata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
COMMAND = re.compile(r"(?:^|[\s;|&(`'\"])entmtp-hf\s+([a-z][a-z0-9-]*)")

# work-log language a user on their own machine has no use for
WORK_LOG = [
    re.compile(r"\bround[- ]\d", re.I),
    re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)-round\b", re.I),
    re.compile(r"\bthis CPU\b", re.I),
    re.compile(r"\breduced speed\b", re.I),
    re.compile(r"\bissue\s*#?\d+", re.I),
    re.compile(r"\b(?:the )?\w+ issue's\b", re.I),
]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without fenced code blocks (links and headings there are not links or headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("\\", "")
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, heading in HEADING.findall(_prose(_text(path))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    prose = INLINE_CODE.sub("", _prose(_text(path)))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def test_pages_exist():
    assert (ROOT / "README.md").is_file() and (DOCS / "results.md").is_file()
    assert len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif dest.is_file() and not dest.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_github():
    assert slug("Machine entries and `entmtp-hf calibrate`") == "machine-entries-and-entmtp-hf-calibrate"
    assert slug("Intel Xeon (Sapphire Rapids), 2 vCPUs") == "intel-xeon-sapphire-rapids-2-vcpus"
    assert slug("A `custom_generate` repo") == "a-custom_generate-repo"
    assert slug("EntMTP\\* on a GPU") == "entmtp-on-a-gpu"


def named_commands() -> dict[str, list[str]]:
    """`entmtp-hf <command>` written in the pages' code (inline or fenced) -> the pages naming it."""
    named: dict[str, list[str]] = {}
    for page in PAGES:
        text = _text(page)
        code = [m.group(0) for m in FENCE.finditer(text)] + INLINE_CODE.findall(_prose(text))
        for chunk in code:
            for command in COMMAND.findall(chunk):
                named.setdefault(command, []).append(page.name)
    return named


def test_named_commands_have_help(capsys):
    from entmtp_hf.tools.cli import build_parser, main

    named = named_commands()
    assert {"calibrate", "search", "bench", "train-heads"} <= set(named)
    parser = build_parser()
    registered = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse keeps them there
    unknown = {c: pages for c, pages in named.items() if c not in registered}
    assert not unknown, f"commands the docs name that the CLI lacks: {unknown}"
    for command in ["--help", *sorted(named)]:
        argv = [command] if command == "--help" else [command, "--help"]
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 0, f"entmtp-hf {' '.join(argv)} exited {stop.value.code}"
        out = capsys.readouterr().out
        assert "usage: entmtp-hf" in out


def readme_python(section: str) -> str:
    """The first ```python block under the README heading ``section``."""
    text = _text(ROOT / "README.md")
    start = re.search(rf"^## {re.escape(section)}\b.*$", text, re.M)
    assert start, f"README has no section {section!r}"
    block = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start.end())
    assert block, f"no python block under {section!r}"
    return block.group(1)


class TinyTokenizer:
    """A stand-in with the calls the README makes: a chat template, plain encoding, decoding."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def _ids(self, text: str) -> torch.Tensor:
        return torch.tensor([[ord(ch) % self.vocab for ch in text[:12]]])

    def _batch(self, ids: torch.Tensor) -> dict:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def apply_chat_template(self, messages, add_generation_prompt=False, return_tensors=None, return_dict=False):
        assert add_generation_prompt and return_tensors == "pt" and return_dict
        return self._batch(self._ids(" ".join(m["content"] for m in messages)))

    def __call__(self, text: str, return_tensors=None):
        assert return_tensors == "pt"
        return self._batch(self._ids(text))

    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture
def tiny_bank_dir(tmp_path: Path) -> Path:
    """The published default trees filed under the README's task names, for the tiny model."""
    from entmtp_hf import TopologyBank
    from entmtp_hf.banks.bank import published_defaults_bank

    defaults = published_defaults_bank()
    for task in ("humaneval", "gsm8k", "chat"):
        TopologyBank(task, defaults.trees, defaults.metadata).save_pretrained(tmp_path / "banks")
    return tmp_path / "banks"


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 - the README's own code
    return out.getvalue()


def test_readme_quickstart_runs_on_a_tiny_model(monkeypatch, tiny_cache, tiny_bank_dir):
    """The quickstart as written, with ``load_demo`` returning a tiny model with fitted heads."""
    from tiny import VOCAB

    import entmtp_hf.demo
    from entmtp_hf import disable_entmtp, enable_entmtp

    model, heads = tiny_cache("llama", "hydra")
    calls = []

    def tiny_load_demo(heads_name=None, **kwargs):
        calls.append(heads_name)
        enable_entmtp(model, heads)
        return model, TinyTokenizer(VOCAB), tiny_bank_dir

    monkeypatch.setattr(entmtp_hf.demo, "load_demo", tiny_load_demo)
    code = readme_python("Quickstart")
    assert "load_demo()" in code and "EntMTPConfig(bank=bank_dir" in code
    try:
        printed = _run(code)
    finally:
        disable_entmtp(model)
    assert calls == [None]
    lines = printed.strip().splitlines()
    assert len(lines) >= 2 and lines[-1].endswith("tokens per step")
    assert float(lines[-1].split()[0]) >= 1.0


def test_readme_own_model_runs_on_a_tiny_model(monkeypatch, tiny_cache):
    """The "your own model" snippet with the Hub loads replaced by a tiny model and its heads."""
    import transformers
    from tiny import VOCAB

    import entmtp_hf

    model, heads = tiny_cache("llama", "hydra")
    real_enable = entmtp_hf.enable_entmtp
    loaded = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda name, **kw: loaded.append(name) or model
    )
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: TinyTokenizer(VOCAB))
    monkeypatch.setattr(entmtp_hf, "enable_entmtp", lambda m, name, **kw: loaded.append(name) or real_enable(m, heads))
    code = readme_python("Your own model") + "\nassert out.shape[1] > inputs['input_ids'].shape[1]\n"
    try:
        _run(code)
    finally:
        entmtp_hf.disable_entmtp(model)
    assert len(loaded) == 2


@pytest.mark.slow
def test_readme_quickstart_runs_on_the_demo_model(demo_copy):
    """The quickstart exactly as written: the real demo model with its shipped drafter and banks."""
    demo_copy()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        printed = _run(readme_python("Quickstart"))
    finally:
        torch.set_num_threads(threads)
    answer, rate = printed.strip().rsplit("\n", 1)
    assert answer.strip() and rate.endswith("tokens per step") and float(rate.split()[0]) > 1.0


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_language(page: Path):
    text = _text(page)
    hits = [
        f"{m.group(0)!r} (line {text.count(chr(10), 0, m.start()) + 1})" for rx in WORK_LOG for m in rx.finditer(text)
    ]
    assert not hits, f"{page.relative_to(ROOT)} reads as a lab notebook: " + ", ".join(hits)


def test_size_limits():
    readme_lines = len(_text(ROOT / "README.md").splitlines())
    results_lines = len(_text(DOCS / "results.md").splitlines())
    docs_bytes = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert readme_lines < 160, f"README.md has {readme_lines} lines"
    assert results_lines < 250, f"docs/results.md has {results_lines} lines"
    assert docs_bytes < 2 * 1024 * 1024, f"docs/ holds {docs_bytes / 2**20:.2f} MiB"


def test_the_usage_pages_option_table_is_the_codes():
    """docs/usage.md's field-by-field table names every option in the row the code's table
    (``entmtp_hf.decoding.options``) puts it in, and no other."""
    from entmtp_hf.decoding.options import GENERATE_ARGUMENTS, GENERATION_OPTIONS, HONOURED, IRRELEVANT, REFUSED

    options = {**GENERATION_OPTIONS, **GENERATE_ARGUMENTS}
    expected = {
        "honoured": {n for n, o in options.items() if o.treatment == HONOURED},
        "refused for some values": {n for n, o in options.items() if o.treatment == HONOURED and o.refusal},
        "refused": {n for n, o in options.items() if o.treatment == REFUSED},
        "not read": {n for n, o in options.items() if o.treatment == IRRELEVANT},
    }
    text = _text(DOCS / "usage.md")
    section = text[text.index("### Every option, field by field") :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and not set(cells[0]) <= {"-"}:
            names = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", re.sub(r"\([^)]*\)", "", cells[1])))
            rows[next((k for k in expected if cells[0].startswith(k)), cells[0])] = names
    rows.pop("what EntMTP does", None)  # the header
    assert rows == expected
