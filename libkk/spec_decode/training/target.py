"""The target's side of drafter distillation (libkk/spec_decode/training/distill.py): running the target on a private
paged KV cache (`TargetRunner`), its continuations of prompts and the hidden states the drafter
learns from, the built-in prompts, and `measure_acceptance`: greedy speculative decoding with a
`DFlashProposer` against the target, reporting the acceptance length (accepted drafts + 1 per
verification step)."""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from libkk.errors import ConfigError
from libkk.layers.forward_context import AttentionMetadata, set_forward_context
from libkk.sample.gumbel import gumbel_argmax
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow
from libkk.spec_decode.base import ProposeRequest
from libkk.spec_decode.dflash import DFlashProposer

# -- running the target -----------------------------------------------------------------------


@dataclass
class Sequence_:
    token_ids: list[int]
    num_cached: int = 0
    blocks: list[int] = field(default_factory=list)


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"target model {type(target).__name__} has no model.layers")
    return layers


class TargetRunner:
    """The target on a private paged KV cache, with the chosen layers' hidden states recorded.

    Use as a context manager: it binds its caches to the target's attention layers and restores
    whatever was bound before on exit.
    """

    def __init__(
        self,
        target: nn.Module,
        layer_ids: Sequence[int],
        num_blocks: int = 512,
        block_size: int = 16,
    ) -> None:
        self.target = target
        self.layer_ids = tuple(layer_ids)
        self.block_size = block_size
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.caches = [
            torch.zeros(
                (2, num_blocks, block_size, a.num_kv_heads, a.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            for a in target.attention_layers()
        ]
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self._recorded: dict[int, torch.Tensor] = {}

    def __enter__(self) -> TargetRunner:
        attns = self.target.attention_layers()
        self._previous = [a.kv_cache for a in attns]
        for a, cache in zip(attns, self.caches, strict=True):
            a.kv_cache = cache
        layers = decoder_layers(self.target)

        def hook(index: int) -> Callable[..., None]:
            def record(module: nn.Module, args: Any, output: Any) -> None:
                hidden, residual = output  # the residual stream is carried separately
                self._recorded[index] = hidden + residual

            return record

        self._hooks = [layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        for a, cache in zip(self.target.attention_layers(), self._previous, strict=True):
            a.kv_cache = cache

    def release(self, seq: Sequence_) -> None:
        self.free.extend(seq.blocks)
        seq.blocks = []

    @torch.no_grad()
    def step(self, seqs: list[Sequence_]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Runs every sequence's uncached tokens as one flat batch; marks them cached.

        Returns (final hidden [T, H], chosen layers' hidden [T, len(ids) * H], query starts).
        """
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for s in seqs:
            needed = -(-len(s.token_ids) // self.block_size)
            while len(s.blocks) < needed:
                if not self.free:
                    raise RuntimeError("TargetRunner ran out of KV blocks; raise num_blocks")
                s.blocks.append(self.free.pop())
            for p in range(s.num_cached, len(s.token_ids)):
                ids.append(s.token_ids[p])
                pos.append(p)
                slots.append(s.blocks[p // self.block_size] * self.block_size + p % self.block_size)
            starts.append(len(ids))
            seq_lens.append(len(s.token_ids))
        width = max(len(s.blocks) for s in seqs)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(
                [s.blocks + [0] * (width - len(s.blocks)) for s in seqs],
                dtype=torch.int32,
                device=dev,
            ),
            block_size=self.block_size,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        self._recorded.clear()
        with set_forward_context(metadata, self.target):
            hidden = self.target(
                torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev),
            )
        layers = torch.cat([self._recorded[i] for i in self.layer_ids], dim=-1)
        for s in seqs:
            s.num_cached = len(s.token_ids)
        return hidden, layers, starts


def generate(
    runner: TargetRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
    progress: bool = True,
) -> list[list[int]]:
    """The target's continuations of each prompt (token ids, ending at a stop token or the cap);
    random rows use keyed Gumbel noise at (seed + prompt index, position)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    stop = set(stop_ids)
    bar = tqdm(total=len(prompts), desc="Generating", file=sys.stderr, disable=not progress)
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        seqs = {i: Sequence_(list(prompts[i])) for i in idx}
        live = list(idx)
        while live:
            hidden, _, starts = runner.step([seqs[i] for i in live])
            logits = runner.target.compute_logits(hidden[[e - 1 for e in starts[1:]]])
            if temperature > 0:
                seeds = torch.tensor([seed + i for i in live], dtype=torch.int64)
                positions = torch.tensor([len(seqs[i].token_ids) for i in live])
                tokens = gumbel_argmax(logits.cpu() / temperature, seeds, positions)
            else:
                tokens = logits.argmax(dim=-1)
            still = []
            for i, t in zip(live, tokens.tolist(), strict=True):
                outputs[i].append(t)
                seqs[i].token_ids.append(t)
                if t in stop or len(outputs[i]) >= max_new_tokens:
                    runner.release(seqs[i])
                    bar.update(1)
                else:
                    still.append(i)
            live = still
    bar.close()
    return outputs


@torch.no_grad()
def target_hidden_states(
    runner: TargetRunner, sequences: Sequence[Sequence[int]], max_tokens_per_step: int = 4096
) -> list[torch.Tensor]:
    """[len(seq), len(ids) * H] chosen-layer hidden states of each whole sequence (CPU, bf16)."""
    out: list[torch.Tensor] = []
    batch: list[Sequence_] = []

    def flush() -> None:
        if not batch:
            return
        _, layers, starts = runner.step(batch)
        for j, s in enumerate(batch):
            out.append(layers[starts[j] : starts[j + 1]].to("cpu", torch.bfloat16))
            runner.release(s)
        batch.clear()

    for seq in sequences:
        if batch and sum(len(s.token_ids) for s in batch) + len(seq) > max_tokens_per_step:
            flush()
        batch.append(Sequence_(list(seq)))
    flush()
    return out


# -- acceptance --------------------------------------------------------------------------------


@dataclass
class AcceptanceReport:
    mean_acceptance_length: float  # accepted drafts + 1, averaged over verification steps
    verification_steps: int
    generated_tokens: int
    outputs: list[list[int]]


@torch.no_grad()
def measure_acceptance(
    target: nn.Module,
    proposer: DFlashProposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    num_drafts: int | None = None,
    progress: bool = False,
) -> AcceptanceReport:
    """Greedy speculative decoding with `proposer`: each step verifies the drafts with one target
    forward over [last token, drafts], keeps the matching prefix plus the target's own token."""
    k = num_drafts or proposer.num_drafts
    stop = set(stop_ids)
    lengths: list[int] = []
    outputs: list[list[int]] = []
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    with TargetRunner(target, proposer.target_layer_ids) as runner:
        for n, prompt in enumerate(tqdm(prompts, disable=not progress, file=sys.stderr)):
            rid = f"accept-{n}"
            seq = Sequence_(list(prompt))
            hidden, layers, _ = runner.step([seq])
            token = int(target.compute_logits(hidden[-1:]).argmax(-1))
            proposer.add_context(rid, 0, layers)
            out = [token]
            while token not in stop and len(out) < max_new_tokens:
                tokens = seq.token_ids + [token]
                row = SamplingRow(greedy, 0, len(tokens), prompt, out)
                budget = min(k, max_new_tokens - len(out) - 1)
                drafts = proposer.propose([ProposeRequest(rid, tokens, row, budget)]).token_ids[0]
                start = len(seq.token_ids)
                seq.token_ids = tokens + drafts
                hidden, layers, _ = runner.step([seq])
                verified = target.compute_logits(hidden).argmax(-1).tolist()  # [1 + n]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
                    accepted += 1
                new = drafts[:accepted] + [verified[accepted]]
                # Only the anchor and the accepted drafts stay: their hidden states are final.
                proposer.add_context(rid, start, layers[: accepted + 1])
                seq.token_ids = tokens + drafts[:accepted]
                seq.num_cached = len(seq.token_ids)
                for t in new:
                    if len(out) < max_new_tokens and out[-1] not in stop:
                        out.append(t)
                token = out[-1]
                lengths.append(accepted + 1)
            proposer.remove(rid)
            runner.release(seq)
            outputs.append(out)
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    return AcceptanceReport(mean, len(lengths), sum(len(o) for o in outputs), outputs)


# -- prompts ----------------------------------------------------------------------------------

_TOPICS = (
    "the water cycle",
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "volcanoes",
    "machine learning",
    "the immune system",
    "climate change",
    "the Roman Empire",
    "electricity",
    "the stock market",
    "honey bees",
    "the moon landing",
    "vaccines",
    "plate tectonics",
    "the internet",
    "renewable energy",
    "the human heart",
    "ancient Egypt",
    "gravity",
    "recycling",
    "the printing press",
    "dinosaurs",
    "rainbows",
    "the Olympic Games",
    "coffee",
    "chess",
    "the Great Wall of China",
    "earthquakes",
    "sleep",
    "music theory",
    "the solar system",
    "bread baking",
    "democracy",
    "oceans",
    "friendship",
    "exercise",
    "the Amazon rainforest",
    "computers",
    "time management",
    "gardening",
    "birds",
    "the periodic table",
    "money",
    "languages",
    "Shakespeare",
    "cats",
    "the weather",
    "space travel",
    "healthy eating",
    "mountains",
    "trains",
    "the brain",
    "robots",
    "pyramids",
    "the Moon",
    "the Sun",
    "electric cars",
    "airplanes",
    "the Titanic",
    "the Industrial Revolution",
    "World War I",
    "the Cold War",
    "the Vikings",
    "ancient Greece",
    "the Maya",
    "samurai",
    "castles",
    "knights",
    "pirates",
    "the Wright brothers",
    "Albert Einstein",
    "Marie Curie",
    "Isaac Newton",
    "Leonardo da Vinci",
    "Charles Darwin",
    "DNA",
    "cells",
    "bacteria",
    "viruses",
    "evolution",
    "fossils",
    "genetics",
    "the skeleton",
    "muscles",
    "the lungs",
    "digestion",
    "nutrition",
    "vitamins",
    "allergies",
    "the five senses",
    "memory",
    "dreams",
    "emotions",
    "habits",
    "stress",
    "meditation",
    "yoga",
    "running",
    "swimming",
    "soccer",
    "basketball",
    "tennis",
    "the Tour de France",
    "marathons",
    "chess openings",
    "video games",
    "board games",
    "photography",
    "painting",
    "sculpture",
    "architecture",
    "cinema",
    "animation",
    "theater",
    "opera",
    "the guitar",
    "the piano",
    "drums",
    "hip hop",
    "classical music",
    "folk tales",
    "mythology",
    "dragons",
    "fairy tales",
    "poetry",
    "novels",
    "comic books",
    "journalism",
    "social media",
    "smartphones",
    "batteries",
    "solar panels",
    "wind turbines",
    "nuclear power",
    "hydroelectric dams",
    "oil",
    "natural gas",
    "electric grids",
    "semiconductors",
    "lasers",
    "magnets",
    "sound waves",
    "light",
    "colors",
    "temperature",
    "ice",
    "snow",
    "hurricanes",
    "lightning",
    "clouds",
    "rain",
    "rivers",
    "lakes",
    "waterfalls",
    "caves",
    "islands",
    "forests",
    "savannas",
    "wetlands",
    "the Arctic",
    "Antarctica",
    "the Sahara",
    "the Himalayas",
    "the Nile",
    "the Pacific Ocean",
    "elephants",
    "lions",
    "tigers",
    "whales",
    "dolphins",
    "sharks",
    "butterflies",
    "ants",
    "spiders",
    "frogs",
    "snakes",
    "horses",
    "dogs",
    "owls",
    "eagles",
    "parrots",
    "trees",
    "flowers",
    "mushrooms",
    "seeds",
    "farming",
    "rice",
    "chocolate",
    "cheese",
    "pizza",
    "spices",
    "cooking",
    "baking cookies",
    "vegetarian food",
    "water purification",
    "plastic pollution",
    "air pollution",
    "endangered species",
    "national parks",
    "cities",
    "public transport",
    "roads",
    "cars",
    "ships",
    "rockets",
    "satellites",
    "the International Space Station",
    "Mars",
    "Jupiter",
    "stars",
    "galaxies",
    "telescopes",
    "the Big Bang",
    "mathematics",
    "prime numbers",
    "geometry",
    "fractions",
    "probability",
    "statistics",
    "algorithms",
    "programming",
    "databases",
    "cybersecurity",
    "passwords",
    "encryption",
    "cloud computing",
    "artificial intelligence",
    "the economy",
    "inflation",
    "taxes",
    "banks",
    "small businesses",
    "marketing",
    "job interviews",
    "teamwork",
    "leadership",
    "public speaking",
    "writing essays",
    "learning a language",
    "studying for exams",
    "school",
    "universities",
    "museums",
    "holidays",
    "birthdays",
    "weddings",
    "family traditions",
    "recycling at home",
    "saving money",
    "budgeting",
    "shopping",
    "fashion",
    "the history of clocks",
    "calendars",
    "maps",
    "compasses",
    "the alphabet",
    "numbers",
    "writing systems",
    "the postal service",
    "telephones",
    "radio",
    "television",
    "newspapers",
    "the camera",
)
_HELD_OUT_TOPICS = (
    "lighthouses",
    "jazz",
    "glaciers",
    "the Silk Road",
    "octopuses",
    "bicycles",
    "tea",
    "submarines",
    "deserts",
    "fireworks",
    "penguins",
    "bridges",
    "libraries",
    "tornadoes",
    "the Renaissance",
    "coral reefs",
    "windmills",
    "origami",
    "wolves",
    "comets",
)
_TEMPLATES = (
    "Explain {} to a ten-year-old.",
    "Write a short paragraph about {}.",
    "What are three interesting facts about {}?",
    "Give me a simple summary of {}.",
    "Why is {} important?",
    "Write a short poem about {}.",
    "List some common questions people ask about {}, with answers.",
    "Describe {} in a few sentences.",
)


# Openings of plain text (no chat template): the starts of documents, notes and code that a
# completion prompt continues.
_PLAIN_TEMPLATES = (
    "An introduction to {}.\n\n",
    "# {}\n\n",
    "Here are three facts about {}:\n\n1.",
    "The history of {} begins",
    "Q: What is {}?\nA:",
    "Notes on {}:\n-",
)
_CODE_SIGNATURES = (
    "is_prime(n)", "factorial(n)", "gcd(a, b)", "reverse_string(s)", "binary_search(items, x)",
    "merge_sort(items)", "count_words(text)", "flatten(nested)", "mean(values)",
    "transpose(matrix)", "is_palindrome(s)", "quicksort(items)", "read_lines(path)",
    "word_frequencies(text)", "celsius_to_fahrenheit(c)", "unique(items)", "chunks(items, size)",
    "max_subarray(nums)", "levenshtein(a, b)", "matrix_multiply(a, b)", "parse_csv(text)",
    "to_snake_case(name)", "median(values)", "primes_below(n)",
)  # fmt: skip
_HELD_OUT_CODE_SIGNATURES = (
    "fib(n)", "bubble_sort(items)", "is_anagram(a, b)", "sum_digits(n)",
    "capitalize_words(text)", "find_duplicates(items)", "power_set(items)", "rotate(items, k)",
)  # fmt: skip
_CODE_TEMPLATES = ("def {}:", "def {}:\n    ")


def builtin_prompts(held_out: bool = False, extra_topics: Sequence[str] = ()) -> list[str]:
    """Instruction prompts for the chat template (topics x templates); the held-out set shares no
    topic with the rest. `extra_topics` join the training topics (`listed_topics`)."""
    topics = _HELD_OUT_TOPICS if held_out else _TOPICS + tuple(extra_topics)
    prompts = [t.format(topic) for topic in topics for t in _TEMPLATES]
    random.Random(1234).shuffle(prompts)
    return prompts


def builtin_plain_prompts(
    held_out: bool = False, extra_topics: Sequence[str] = (), extra_signatures: Sequence[str] = ()
) -> list[str]:
    """Plain-text openings to continue without a chat template: prose starts over the topics and
    Python function heads, one in four of them code; the held-out set shares no topic or function
    with the rest. The extra topics and function heads join the training ones."""
    topics = _HELD_OUT_TOPICS if held_out else _TOPICS + tuple(extra_topics)
    signatures = (
        _HELD_OUT_CODE_SIGNATURES if held_out else _CODE_SIGNATURES + tuple(extra_signatures)
    )
    rng = random.Random(1234)
    prose = [_capitalized(t.format(topic)) for topic in topics for t in _PLAIN_TEMPLATES]
    code = [t.format(sig) for sig in signatures for t in _CODE_TEMPLATES]
    rng.shuffle(prose)
    rng.shuffle(code)
    mixed = []
    for i, text in enumerate(prose):  # every fourth prompt code, while code lasts
        if i % 3 == 0 and code:
            mixed.append(code.pop())
        mixed.append(text)
    return mixed + code


def wide_topics(
    runner: TargetRunner, tokenizer: Any, stop_ids: Sequence[int] = (), progress: bool = True
) -> list[str]:
    """Training topics beyond the built-in ones: `listed_topics`, then `vocabulary_topics`, each
    once (case aside) and none built in already."""
    seen = {t.lower() for t in _TOPICS}
    topics = []
    for topic in listed_topics(runner, tokenizer, stop_ids, progress) + vocabulary_topics(
        tokenizer
    ):
        if topic.lower() not in seen:
            seen.add(topic.lower())
            topics.append(topic)
    return topics


# Kinds of things the target is asked to list (`listed_topics`): a broad spread, so that the
# training topics reach far beyond the hand-written ones above.
_TOPIC_CATEGORIES = (
    "animals", "birds", "insects", "fish", "trees", "flowers", "fruits", "vegetables", "spices",
    "dishes from around the world", "desserts", "drinks", "sports", "board games",
    "musical instruments", "music genres", "dances", "jobs", "tools", "machines", "vehicles",
    "famous buildings", "natural wonders", "weather phenomena", "parts of the human body",
    "diseases", "emotions", "fields of science", "chemical elements", "minerals and gemstones",
    "planets and moons", "inventions", "historical events", "ancient civilizations", "countries",
    "cities", "rivers", "mountains", "islands", "art movements", "programming languages",
    "computer parts", "household objects", "clothing items", "holidays and festivals", "hobbies",
    "crafts", "school subjects", "mathematical concepts", "physics concepts", "economic ideas",
    "philosophical ideas", "materials", "energy sources", "space missions", "kinds of boats",
    "farm activities", "types of rocks", "cooking methods", "medical devices", "internet services",
    "literary genres", "martial arts", "camping gear", "kitchen utensils", "habits of good sleep",
)  # fmt: skip
_LIST_REQUESTS = (
    "List 20 {}, one per line, names only.",
    "Name 15 {} that many people have never heard of, one per line.",
)


def listed_topics(
    runner: TargetRunner, tokenizer: Any, stop_ids: Sequence[int] = (), progress: bool = True
) -> list[str]:
    """Topics the target names itself when asked to list kinds of things (greedy, the chat
    template): the names parsed out of its lists, deduplicated, none that shares a word with a
    held-out topic (so the held-out prompts stay unseen)."""
    asks = [r.format(c) for c in _TOPIC_CATEGORIES for r in _LIST_REQUESTS]
    lists = generate(
        runner, [chat_prompt_ids(tokenizer, a) for a in asks], 160, stop_ids, progress=progress
    )
    seen = set()
    topics = []
    for tokens in lists:
        for line in tokenizer.decode(tokens).splitlines():
            name = _listed_name(line)
            if name and name.lower() not in seen and not _near_held_out(name):
                seen.add(name.lower())
                topics.append(name)
    return topics


def _listed_name(line: str) -> str | None:
    """The name a list item gives ("3. **Kayak** - a small boat" -> "Kayak"), or None (not a
    list item, or not a short name)."""
    item = re.match(r"\s*(?:\d+[.)]|[-*•])\s*(.*)", line)
    if item is None:
        return None
    name = re.split(r"[:(\u2013\u2014]| - ", item.group(1).replace("*", ""))[0].strip(" .,;")
    if re.fullmatch(r"[A-Za-z][A-Za-z' &-]{2,39}", name) and len(name.split()) <= 5:
        return name
    return None


def _topic_words(topic: str) -> set[str]:
    """A topic's words in lower case, each also without a plural's s or es ("the tornadoes" ->
    {"tornadoes", "tornadoe", "tornado"}): two topics share a word if these sets meet."""
    words = {w for w in re.findall(r"[a-z]+", topic.lower()) if w != "the"}
    return (
        words
        | {w[:-1] for w in words if w.endswith("s")}
        | {w[:-2] for w in words if w.endswith("es")}
    )


_HELD_OUT_WORDS = frozenset(w for t in _HELD_OUT_TOPICS for w in _topic_words(t))


def _near_held_out(topic: str) -> bool:
    """Whether `topic` shares a word with a held-out topic (it would then leak into training)."""
    return bool(_topic_words(topic) & _HELD_OUT_WORDS)


# Endings of abstract and technical nouns ("ventilation", "surveillance", "conductivity").
_NOUN_ENDINGS = (
    "tion", "sion", "ism", "ology", "graphy", "ment", "ness", "ity", "ics", "ance", "ence",
    "ship", "hood", "ure", "cy", "sis",
)  # fmt: skip


def vocabulary_topics(tokenizer: Any) -> list[str]:
    """Nouns of the target's own vocabulary: word-start tokens (byte-level BPE's "Ġ", or
    SentencePiece's "▁") of six or more lower-case letters with a noun's ending, none sharing a
    word with a held-out topic (thousands of topics for a typical vocabulary)."""
    topics = set()
    for i in range(tokenizer.vocab_size):
        token = tokenizer.id_to_token(i) or ""
        word = token[1:]
        if token[:1] in ("\u0120", "\u2581") and re.fullmatch(r"[a-z]{6,}", word):
            if word.endswith(_NOUN_ENDINGS) and not _near_held_out(word):
                topics.add(word)
    return sorted(topics)


# Standard-library modules whose public Python functions give code prompts (`library_signatures`).
_SIGNATURE_MODULES = (
    "base64", "bisect", "calendar", "colorsys", "copy", "csv", "difflib", "fnmatch", "fractions",
    "glob", "gzip", "heapq", "html", "ipaddress", "json", "mimetypes", "ntpath", "posixpath",
    "pprint", "quopri", "random", "shlex", "shutil", "statistics", "string", "tempfile",
    "textwrap", "tokenize", "urllib.parse", "uu", "uuid", "zipfile",
)  # fmt: skip


def library_signatures() -> list[str]:
    """Function heads ("name(a, b=None)" as "name(a, b)") of the public Python functions of some
    standard-library modules, none with a held-out name: many more code prompts than the
    hand-written ones."""
    import importlib
    import inspect
    import warnings

    held_out = {s.split("(")[0] for s in _HELD_OUT_CODE_SIGNATURES}
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    heads = set()
    for name in _SIGNATURE_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:  # removed in this Python
            continue
        for attr, fn in vars(module).items():
            if attr.startswith("_") or attr in held_out or not inspect.isfunction(fn):
                continue
            try:
                params = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):
                continue
            args = ", ".join(stars.get(p.kind, "") + p.name for p in params)
            heads.add(f"{attr}({args})")
    return sorted(heads)


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a one-turn chat prompt (the chat template if the tokenizer has one)."""
    if getattr(tokenizer, "has_chat_template", False):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)
