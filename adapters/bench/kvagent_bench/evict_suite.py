"""Cases for the eviction benchmark: long prose with planted facts, and plain passages for perplexity.

Pure logic: no model, no backend. Token counts come from a ``count_tokens`` callable the caller passes in
(the model's tokenizer in the benchmark, a whitespace counter in the unit tests).

The prose is real public-domain text shipped in the package (``kvagent/data/prose/*.txt``, sources in
``SOURCES.md`` beside them, read by :func:`kvagent.data.load_prose`): contiguous excerpts of five
19th-century English books, one paragraph per block, paragraphs separated by a blank line. Nothing is
downloaded at run time.

Retention cases (:func:`make_retention_cases`): a short instruction, then a contiguous passage of one book
(random book, random start at a paragraph boundary) grown paragraph by paragraph until the whole prompt
reaches ``target_tokens``. A few invented facts ("Note: the access code for the north gate is 4817.") are
inserted at sentence boundaries; the question asks about one of them. The values are drawn from fixed pools
by a seeded RNG, so they cannot be guessed from the prose, and the answer is short (one to three words) so
that it can be judged on the first generated tokens (:func:`score_answer`). Over consecutive cases three
things cycle so that a run of 30 is balanced: the number of facts (1, 2, 4), the depth band of the asked
fact (early, middle, late: :data:`BANDS`) and the asked fact's kind (:data:`ASKED_GROUPS`: code, name,
number, date, the rest); the other facts sit at uniform depths.

Streaming texts (:func:`make_stream_texts`): contiguous passages of at least ``target_tokens`` tokens, for
measuring perplexity while the cache is being evicted.

Everything is deterministic for a seed: case ``i`` of a call depends only on ``(seed, i)``, so the first
``k`` cases of ``n`` are the cases of a call with ``n = k``.
"""

from __future__ import annotations

import logging
import random
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvagent.data import load_prose

log = logging.getLogger(__name__)

INSTRUCTION = (
    "Read the following text carefully. A few notes, each starting with \"Note:\", are hidden in it. "
    "Remember them: at the end you will be asked about one of them."
)
QUESTION_SEPARATOR = "\n\n"
PARAGRAPH_SEPARATOR = "\n\n"
DEPTH_RANGE = (0.05, 0.95)
# where the asked fact is planted, as a fraction of the passage (the other facts: anywhere in DEPTH_RANGE)
BANDS: dict[str, tuple[float, float]] = {"early": (0.05, 0.30), "middle": (0.35, 0.65), "late": (0.70, 0.95)}
# facts per case, cycled over the cases when make_retention_cases is not given a fixed number
FACTS_CYCLE = (1, 2, 4)

# Words before a full stop that do not end a sentence ("Mr. Bennet", "St. James's", "Co."); single letters
# (initials such as "R. Walton", "U. S. A.") are handled separately.
ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "st", "messrs", "mme", "mlle", "esq", "co", "no", "vol", "rev", "capt", "col", "gen",
     "lt", "sgt", "prof", "jr", "sr", "vs", "etc"}
)
# A sentence end: terminal punctuation, optional closing quotes or brackets, whitespace, then a capital
# (optionally after an opening quote).
_SENTENCE_END = re.compile(r"[.!?][\"”’')\]]*\s+(?=[\"“‘']?[A-Z])")


# --- the shipped prose (read by kvagent.data.load_prose) ------------------------------------------------------


def split_paragraphs(text: str) -> list[str]:
    """The non-empty paragraphs of a text whose paragraphs are separated by blank lines."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def sentence_starts(paragraph: str) -> list[int]:
    """Offsets in ``paragraph`` where a sentence starts: 0, and after each sentence end.

    A sentence end is ``.``, ``!`` or ``?`` (with any closing quotes) followed by whitespace and a capital
    letter, not after a common abbreviation or an initial ("Mr. Bennet", "R. Walton"), and not inside an
    open double quotation (straight quotes counted by parity, curly ones by balance), so a note is not put
    in the middle of a character's speech when the text marks speech with double quotes.
    """
    starts = [0]
    for m in _SENTENCE_END.finditer(paragraph):
        pos = m.end()
        head = paragraph[: m.start() + 1]
        word = re.search(r"(\S+)$", head)
        stem = word.group(1).rstrip(".!?").lstrip("\"“‘'(").lower() if word else ""
        if head.endswith(".") and (stem in ABBREVIATIONS or (len(stem) == 1 and stem.isalpha())):
            continue
        before = paragraph[:pos]
        if before.count('"') % 2 == 1 or before.count("“") > before.count("”"):
            continue
        starts.append(pos)
    return starts


class _Corpus:
    """The prose split into paragraphs, with per-paragraph token counts computed lazily per book."""

    def __init__(self, count_tokens: Callable[[str], int]) -> None:
        self.count_tokens = count_tokens
        self.books = {slug: split_paragraphs(text) for slug, text in load_prose().items()}
        self.slugs = sorted(self.books)
        self._counts: dict[str, list[int]] = {}
        # the blank line between paragraphs, which per-paragraph counts leave out, as it tokenizes between two
        # words (0 for a word counter; "\n\n" alone can be one token where it is two in running text)
        self.separator_tokens = max(0, count_tokens("x" + PARAGRAPH_SEPARATOR + "x") - 2 * count_tokens("x"))

    def counts(self, slug: str) -> list[int]:
        if slug not in self._counts:
            self._counts[slug] = [self.count_tokens(p) for p in self.books[slug]]
        return self._counts[slug]

    def start(self, rng: random.Random, needed_tokens: int) -> tuple[str, int]:
        """A random book and a random paragraph from which the rest of that book holds ``needed_tokens``
        (by the per-paragraph estimate); the first paragraph if no start has enough."""
        slug = rng.choice(self.slugs)
        counts = self.counts(slug)
        remaining, suffix = 0, [0] * len(counts)
        for j in range(len(counts) - 1, -1, -1):
            remaining += counts[j]
            suffix[j] = remaining
        eligible = [j for j, s in enumerate(suffix) if s >= needed_tokens]
        if not eligible:
            log.info("book %s is shorter than %d tokens; the passage continues into the next book", slug, needed_tokens)
            return slug, 0
        return slug, eligible[rng.randrange(len(eligible))]

    def paragraphs_from(self, slug: str, index: int) -> Iterator[tuple[str, int]]:
        """Paragraphs from ``(slug, index)`` on, continuing into the following books (in slug order) and
        stopping after one full pass over the corpus; yields ``(paragraph, estimated_tokens)``."""
        b = self.slugs.index(slug)
        for k in range(len(self.slugs) + 1):
            book = self.slugs[(b + k) % len(self.slugs)]
            paras, counts = self.books[book], self.counts(book)
            lo = index if k == 0 else 0
            hi = len(paras) if k < len(self.slugs) else index
            if k > 0 and lo < hi:
                log.info("passage continues from book %s into book %s", self.slugs[(b + k - 1) % len(self.slugs)], book)
            for j in range(lo, hi):
                yield paras[j], counts[j]


# --- facts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fact:
    """One planted fact: ``sentence`` states that ``key`` is ``value``; the question asks for ``key``.

    ``kind`` names the template it came from (for accuracy per kind).
    """

    key: str
    value: str
    sentence: str
    kind: str = ""


FIRST_NAMES = [
    "Aldous", "Berenice", "Cosmo", "Dorcas", "Evander", "Philippa", "Gideon", "Hester", "Ignatius", "Juniper",
    "Leopold", "Marisol", "Octavia", "Percival", "Rosalind", "Thaddeus", "Wilhelmina", "Ambrose", "Clementine",
    "Barnaby", "Isolde", "Lazarus", "Perpetua", "Silas",
]
SURNAMES = [
    "Fenwick", "Ashcombe", "Brindle", "Calloway", "Drummond", "Everleigh", "Farrow", "Galloway", "Hollis", "Ivers",
    "Kettering", "Larkspur", "Merriweather", "Norcott", "Pendry", "Quillon", "Ravensworth", "Stroud",
    "Thistlewood", "Underhill", "Vantreight", "Whitlock", "Yarrow", "Zeller",
]
TITLES = ["Dr.", "Captain", "Professor", "Mrs.", "Sergeant", "Miss"]
DIRECTIONS = ["north", "south", "east", "west", "upper", "lower", "old", "new"]
LOCKED_PLACES = ["gate", "vault", "boathouse", "storeroom", "archive", "cellar", "chapel door", "signal box"]
ROLES = [
    "ship's cook", "night porter", "lighthouse keeper", "head gardener", "village clockmaker", "ferry pilot",
    "stable master", "court archivist", "organ tuner", "harbour master",
]
COLOURS = [
    "crimson", "turquoise", "amber", "violet", "ochre", "scarlet", "teal", "magenta", "indigo", "silver",
    "saffron", "emerald", "maroon", "lavender",
]
OWNED_THINGS = ["umbrella", "bicycle", "front door", "rowing boat", "travelling trunk", "carriage", "scarf"]
CONTAINERS = ["blue tin", "oak chest", "clock case", "flour barrel", "hatbox", "hollow stump"]
SITES = ["the mill", "the inn", "the quay", "the parsonage", "the observatory", "the toll house"]
HIDDEN_OBJECTS = [
    "brass compass", "silver thimble", "glass marble", "pocket watch", "iron key", "ivory comb", "copper kettle",
    "wooden flute", "tin soldier", "pearl button",
]
COUNTED_THINGS = ["lanterns", "barrels", "beehives", "bells", "oars", "chimneys"]
TOWNS = [
    "Marlowick", "Tessbury", "Oakhollow", "Brindlemere", "Quenford", "Ashwell", "Corrisdale", "Fennimoor",
    "Haverlocke", "Pellingham",
]
PASSWORDS = [
    "juniper", "kestrel", "marzipan", "tamarind", "gondola", "quartz", "wombat", "paprika", "zeppelin", "nutmeg",
    "armadillo", "tangerine",
]
EVENTS = ["auction", "regatta", "flood", "harvest fair", "lantern procession", "ribbon cutting", "christening"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def _titled(rng: random.Random) -> str:
    return f"{rng.choice(TITLES)} {rng.choice(SURNAMES)}"


# kind -> rng -> (key, value, stated): the key reads after "What is ..." and before "... is <stated>"; ``stated``
# is the value as the note gives it (with an article for objects), ``value`` the expected answer.
FACT_TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "code": lambda r: _plain(f"the access code for the {r.choice(DIRECTIONS)} {r.choice(LOCKED_PLACES)}",
                             str(r.randint(1000, 9999))),
    "name": lambda r: _plain(f"the name of the {r.choice(ROLES)}", _person(r)),
    "locker": lambda r: _plain(f"the locker number of {_titled(r)}", str(r.randint(100, 999))),
    "colour": lambda r: _plain(f"the colour of {_person(r)}'s {r.choice(OWNED_THINGS)}", r.choice(COLOURS)),
    "object": lambda r: _with_article(f"the object hidden in the {r.choice(CONTAINERS)} at {r.choice(SITES)}",
                                      r.choice(HIDDEN_OBJECTS)),
    "count": lambda r: _plain(f"the number of {r.choice(COUNTED_THINGS)} on the {r.choice(SURNAMES)} estate",
                              str(r.randint(13, 97))),
    "town": lambda r: _plain(f"the town where {_titled(r)} was born", r.choice(TOWNS)),
    "password": lambda r: _plain(f"the password for the {r.choice(DIRECTIONS)} {r.choice(LOCKED_PLACES)}",
                                 r.choice(PASSWORDS)),
    "date": lambda r: _plain(f"the date of the {r.choice(EVENTS)} at {r.choice(SITES)}",
                             f"{r.randint(1, 28)} {r.choice(MONTHS)} {r.randint(1800, 1899)}"),
}
# What the asked fact's kind cycles through, case by case: code, name, number, date, then every other template
# ("the rest"); within a group the kinds take turns (case i asks group i % 5, member (i // 5) % len(group)).
_NAMED_GROUPS: tuple[tuple[str, ...], ...] = (("code",), ("name",), ("count", "locker"), ("date",))
ASKED_GROUPS: tuple[tuple[str, ...], ...] = (
    *_NAMED_GROUPS, tuple(k for k in FACT_TEMPLATES if not any(k in g for g in _NAMED_GROUPS)),
)


def _plain(key: str, value: str) -> tuple[str, str, str]:
    return key, value, value


def _with_article(key: str, value: str) -> tuple[str, str, str]:
    return key, value, ("an " if value[0].lower() in "aeiou" else "a ") + value


def fact_sentence(key: str, stated: str) -> str:
    """The sentence that plants a fact: ``Note: <key> is <stated value>.``"""
    return f"Note: {key} is {stated}."


def question_for(fact: Fact) -> str:
    """The question about a fact; the answer is expected right after ``Answer:``."""
    return f"Question: What is {fact.key}?\nAnswer:"


def make_facts(rng: random.Random, k: int, first_kind: str | None = None) -> list[Fact]:
    """``k`` facts with distinct keys and distinct values, templates cycled in a shuffled order.

    Different templates are used before any repeats (up to the number of templates). ``first_kind``: the
    first fact's template (the others follow in the shuffled order of the rest); ``ValueError`` if unknown.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if first_kind is not None and first_kind not in FACT_TEMPLATES:
        raise ValueError(f"unknown fact kind {first_kind!r}: use one of {', '.join(FACT_TEMPLATES)}")
    kinds = [kind for kind in FACT_TEMPLATES if kind != first_kind]
    rng.shuffle(kinds)
    if first_kind is not None:
        kinds.insert(0, first_kind)
    facts: list[Fact] = []
    keys: set[str] = set()
    values: set[str] = set()
    attempts = 0
    while len(facts) < k:
        attempts += 1
        if attempts > 1000 * (k + 1):
            raise RuntimeError(f"could not draw {k} distinct facts")
        kind = kinds[len(facts) % len(kinds)]
        key, value, stated = FACT_TEMPLATES[kind](rng)
        if key in keys or value.lower() in values:
            continue
        keys.add(key)
        values.add(value.lower())
        facts.append(Fact(key=key, value=value, sentence=fact_sentence(key, stated), kind=kind))
    return facts


# --- retention cases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionCase:
    """A long prompt with planted facts and a question about one of them.

    ``prompt`` is the instruction and the prose with the facts inserted (no question); ``depths[i]`` is where
    ``facts[i].sentence`` starts, as a fraction of ``len(prompt)`` in characters; ``asked`` indexes the fact the
    ``question`` is about and ``answer`` is its value. Feed ``prompt``, evict, then feed
    ``QUESTION_SEPARATOR + question`` (or use :attr:`text` for the whole thing) and judge the generation with
    :func:`score_answer`. ``target_tokens`` is the length the prompt was grown to (at least); ``source`` is the
    slug of the book the passage starts in; ``band`` names the :data:`BANDS` range of the passage the asked
    fact was planted in ("" for a case built without one).
    """

    prompt: str
    facts: tuple[Fact, ...]
    depths: tuple[float, ...]
    question: str
    answer: str
    target_tokens: int
    asked: int = 0
    source: str = ""
    band: str = ""

    @property
    def asked_fact(self) -> Fact:
        """The fact the question is about."""
        return self.facts[self.asked]

    @property
    def asked_kind(self) -> str:
        """The template of the fact the question is about (a key of :data:`FACT_TEMPLATES`)."""
        return self.facts[self.asked].kind

    @property
    def asked_depth(self) -> float:
        """Where the asked fact sits in the prompt (fraction of its characters)."""
        return self.depths[self.asked]

    @property
    def text(self) -> str:
        """Prompt and question together."""
        return self.prompt + QUESTION_SEPARATOR + self.question


def _insert_facts(
    paragraphs: list[str], facts: list[Fact], wanted: list[float]
) -> tuple[str, tuple[float, ...]] | None:
    """The prompt with each fact inserted at the sentence start nearest its wanted depth (distinct starts,
    taken in list order: an earlier fact chooses first), and the depths where the sentences ended up;
    ``None`` if there are fewer sentence starts than facts."""
    passage = PARAGRAPH_SEPARATOR.join(paragraphs)
    candidates: list[int] = []
    offset = 0
    for para in paragraphs:
        candidates.extend(offset + s for s in sentence_starts(para))
        offset += len(para) + len(PARAGRAPH_SEPARATOR)
    if len(candidates) < len(facts):
        return None
    taken: dict[int, Fact] = {}
    for fact, depth in zip(facts, wanted, strict=True):
        target = depth * len(passage)
        pos = min((c for c in candidates if c not in taken), key=lambda c: (abs(c - target), c))
        taken[pos] = fact
    for pos in sorted(taken, reverse=True):
        passage = passage[:pos] + taken[pos].sentence + " " + passage[pos:]
    prompt = INSTRUCTION + PARAGRAPH_SEPARATOR + passage
    depths = tuple(prompt.index(f.sentence) / len(prompt) for f in facts)
    return prompt, depths


def case_plan(i: int, facts_per_case: int | None = None) -> tuple[int, str, str]:
    """What case ``i`` of a run holds: ``(facts, band, asked kind)``.

    Facts cycle over :data:`FACTS_CYCLE` (case ``i % 3``) unless ``facts_per_case`` fixes them; the band over
    :data:`BANDS` by ``(i + i // 3) % 3``, so every (facts, band) pair occurs in 9 consecutive cases and each
    band once in every 3; the kind over :data:`ASKED_GROUPS` (group ``i % 5``, member ``(i // 5) % size``).
    """
    facts = FACTS_CYCLE[i % len(FACTS_CYCLE)] if facts_per_case is None else facts_per_case
    band = list(BANDS)[(i + i // len(BANDS)) % len(BANDS)]
    group = ASKED_GROUPS[i % len(ASKED_GROUPS)]
    return facts, band, group[(i // len(ASKED_GROUPS)) % len(group)]


def _retention_case(
    corpus: _Corpus, rng: random.Random, target_tokens: int, facts_per_case: int, band: str, kind: str
) -> RetentionCase:
    drawn = make_facts(rng, facts_per_case, first_kind=kind)
    asked = rng.randrange(len(drawn))
    facts = drawn[1:asked + 1] + drawn[:1] + drawn[asked + 1:]  # the asked fact (drawn first) at index `asked`
    wanted = [rng.uniform(*BANDS[band]) if j == asked else rng.uniform(*DEPTH_RANGE) for j in range(len(facts))]
    # the asked fact takes its sentence start first, so that it lands nearest to its wanted depth
    order = [asked] + [j for j in range(len(facts)) if j != asked]
    count = corpus.count_tokens
    overhead = count(INSTRUCTION) + sum(count(f.sentence) for f in facts)
    slug, index = corpus.start(rng, target_tokens - overhead)

    paragraphs, stream = _take_paragraphs(corpus, slug, index, overhead, target_tokens)
    while True:
        built = _insert_facts(paragraphs, [facts[j] for j in order], [wanted[j] for j in order])
        if built is not None and count(built[0]) >= target_tokens:
            break
        nxt = next(stream, None)
        if nxt is None:
            raise ValueError(f"the shipped prose is too short for a {target_tokens}-token prompt")
        paragraphs.append(nxt[0])
    prompt = built[0]
    depths = tuple(prompt.index(f.sentence) / len(prompt) for f in facts)
    fact = facts[asked]
    return RetentionCase(
        prompt=prompt,
        facts=tuple(facts),
        depths=depths,
        question=question_for(fact),
        answer=fact.value,
        target_tokens=target_tokens,
        asked=asked,
        source=slug,
        band=band,
    )


def _take_paragraphs(
    corpus: _Corpus, slug: str, index: int, estimate: int, target_tokens: int
) -> tuple[list[str], Iterator[tuple[str, int]]]:
    """Paragraphs from ``(slug, index)`` on until ``estimate`` (tokens already spent) plus their token
    estimates reaches ``target_tokens``; also the stream, to take more if the exact count falls short."""
    paragraphs: list[str] = []
    stream = corpus.paragraphs_from(slug, index)
    for para, tokens in stream:
        paragraphs.append(para)
        estimate += tokens + corpus.separator_tokens
        if estimate >= target_tokens:
            break
    return paragraphs, stream


def make_retention_cases(
    n: int,
    target_tokens: int,
    count_tokens: Callable[[str], int],
    seed: int,
    facts_per_case: int | None = None,
) -> list[RetentionCase]:
    """``n`` retention cases whose prompts have at least ``target_tokens`` tokens by ``count_tokens``.

    Each case: a random book and a random start paragraph (chosen so that the rest of the book is long enough,
    when any start is), the instruction, then paragraphs appended until the prompt with its facts reaches the
    target (a passage longer than the book continues into the next one); facts inserted at the sentence starts
    nearest to their drawn depths; the question about one of them (at a random index of ``facts``). What
    case ``i`` holds is :func:`case_plan`: the number of facts (``facts_per_case`` if given, else cycling
    over 1, 2, 4), the asked fact's kind, and the band of the passage its depth is drawn from (uniformly);
    the other facts' depths are uniform over 0.05-0.95 of the passage. Deterministic: case ``i`` depends
    only on ``(seed, i)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    if facts_per_case is not None and facts_per_case < 1:
        raise ValueError(f"facts_per_case must be >= 1, got {facts_per_case}")
    corpus = _Corpus(count_tokens)
    cases = [
        _retention_case(corpus, random.Random(f"retention:{seed}:{i}"), target_tokens, *case_plan(i, facts_per_case))
        for i in range(n)
    ]
    log.debug("made %d retention cases of >= %d tokens (seed %d)", n, target_tokens, seed)
    return cases


# --- streaming texts -----------------------------------------------------------------------------------------


def make_stream_texts(n: int, target_tokens: int, count_tokens: Callable[[str], int], seed: int) -> list[str]:
    """``n`` contiguous passages of at least ``target_tokens`` tokens each, for streaming perplexity.

    A random book and start paragraph per text (as in :func:`make_retention_cases`), paragraphs joined by a
    blank line. Deterministic: text ``i`` depends only on ``(seed, i)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    corpus = _Corpus(count_tokens)
    texts = []
    for i in range(n):
        rng = random.Random(f"stream:{seed}:{i}")
        slug, index = corpus.start(rng, target_tokens)
        paragraphs, stream = _take_paragraphs(corpus, slug, index, 0, target_tokens)
        text = PARAGRAPH_SEPARATOR.join(paragraphs)
        while count_tokens(text) < target_tokens:
            nxt = next(stream, None)
            if nxt is None:
                raise ValueError(f"the shipped prose is too short for a {target_tokens}-token text")
            paragraphs.append(nxt[0])
            text = PARAGRAPH_SEPARATOR.join(paragraphs)
        texts.append(text)
    log.debug("made %d stream texts of >= %d tokens (seed %d)", n, target_tokens, seed)
    return texts


# --- scoring -------------------------------------------------------------------------------------------------


ARTICLES = ("a", "an", "the")


def normalize_answer(text: str) -> list[str]:
    """Case-folded words of ``text`` with all punctuation removed (Unicode categories P* and S*) and one
    leading article (a, an, the) dropped.

    Punctuation is deleted, not replaced by a space: ``"4,817"`` -> ``["4817"]``, ``"Fenwick."`` ->
    ``["fenwick"]``, ``"Fenwick-Smith"`` -> ``["fenwicksmith"]``; ``"A brass compass"`` -> ``["brass",
    "compass"]``.
    """
    kept = "".join(ch for ch in text.casefold() if not unicodedata.category(ch).startswith(("P", "S")))
    words = kept.split()
    if len(words) > 1 and words[0] in ARTICLES:
        words = words[1:]
    return words


def score_answer(generated: str, answer: str) -> bool:
    """Whether a generation gives ``answer``: after :func:`normalize_answer`, its first words are exactly the
    answer's words.

    So ``" 4817."``, ``"4817 is the code"``, ``"Aldous Fenwick, the cook"`` and ``"a brass compass"`` are right
    for ``4817``, ``Aldous Fenwick`` and ``brass compass``; ``"48170"``, ``"481"``, ``"Aldous"`` (a truncated
    name) and ``"The code is 4817"`` (the answer not first) are wrong. An empty generation or an empty answer
    is never right. Generate at least as many tokens as the longest answer needs (answers here are one to
    three words).
    """
    want = normalize_answer(answer)
    got = normalize_answer(generated)
    return bool(want) and got[: len(want)] == want
