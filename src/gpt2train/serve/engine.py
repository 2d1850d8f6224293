"""Continuous batching: one loop owns the model and one KV cache of max_batch rows; a completion joins the
running batch at the next step (its prompt prefilled into a free row) and leaves it the step it ends.

The loop runs in a thread of its own, so the server's event loop never waits for the model. Each step:
  1. rows whose completion was cancelled leave (an ended one left at the end of its last step), and so do
     cancelled completions still waiting; waiting completions take the free rows;
  2. the last running rows move into the rows that left (BatchCache.move_rows), so a decode step
     reads rows 0..n-1 only; the slots are repacked (BatchCache.realign) only when room is short or many
     slots in use hold no running row's token;
  3. one prefill of the new rows' prompts, left-padded, written just before the slot the decode step
     writes (BatchCache.rows), its first tokens out at once; then that decode step for the rows that were
     running (generation.Decoder, one id per row); at most prefill_tokens prompt tokens join at a step, so
     that a burst of requests does not stall the running rows for long;
  4. rows whose tokens fill the context slide (as `sample` does, docs/model.md "Past the context"): they leave
     the cache, and each step reads each one's last block_size tokens afresh, in one forward for them all;
     a prompt that fills the context alone slides from its first token;
  5. each row draws its next token with its own settings and generator, and its new text (held back while
     a character or a stop string is incomplete) goes to its request's Inbox.
A server that stops drains it (Engine.drain): no completion is taken from then on, those it holds run to their
end for a grace period, and any still held after it are cut at a step's start, each with a last piece.
Greedy rows are the argmax of their own logits, so in float32 a request's greedy tokens are the same
alone or beside others (up to the rounding of batched matmuls, which generate_batch's rows share).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from gpt2train.counting import kv_cache_elements
from gpt2train.generation import Decoder, TextStream, left_padded, sample_next
from gpt2train.model import GPT, KVCache
from gpt2train.ranges import UsageError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit
    seed: int | None = None  # None: a fresh random seed


@dataclass
class Piece:
    """What one completion produced since its last piece: text (possibly empty), the tokens it covers, and
    on its last piece why it ended: "stop" (its end token or a stop string), "length", "error", or "cut" (the
    server stopped first: Engine.drain)."""

    text: str
    tokens: int = 1
    finish_reason: str | None = None


class QueueFull(Exception):
    """More completions than free rows plus the waiting places: try again later."""


class Draining(Exception):
    """The engine takes no new completions: the server is stopping (Engine.drain)."""


class EngineStopped(Exception):
    """The engine's thread has ended on a failure it could not recover from: no completion runs any more."""

    def __init__(self, reason: str):
        super().__init__(f"the engine stopped after a failure it could not recover from ({reason}); restart the "
                         "server")


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class Inbox:
    """Where the pieces of one request's completions arrive, from the engine's thread, to be read on the
    event loop that made it: `await inbox.get()` gives every (index, piece) that came since the last get."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.items: list[tuple[int, Piece]] = []
        self.ready = asyncio.Event()

    def put(self, items: list[tuple[int, Piece]]) -> None:
        """From the engine's thread; RuntimeError if the event loop is closed (the server stopped)."""
        with self.lock:
            self.items.extend(items)
        self.loop.call_soon_threadsafe(self.ready.set)

    async def get(self) -> list[tuple[int, Piece]]:
        await self.ready.wait()
        self.ready.clear()  # before taking: a put after this take sets it again
        with self.lock:
            items, self.items = self.items, []
        return items


@dataclass(eq=False)
class Completion:
    """One row's work: prompt_ids continued by up to max_tokens tokens, ending early at its end token or at
    a stop string (neither is shown). Its pieces go to `inbox` tagged with `index`."""

    prompt_ids: list[int]
    max_tokens: int
    inbox: Inbox
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    index: int = 0
    end_id: int | None = None  # the token that ends it: None is the tokenizer's end-of-text (a chat reply's <|im_end|>)
    cancelled: bool = False
    finished: bool = False  # its last piece is out: no other piece may follow (the app counts the last ones)

    def cancel(self) -> None:
        """Free its row (or its waiting place) at the engine's next step; no more pieces come."""
        self.cancelled = True


class StopText:
    """Text as a completion may show it: up to the first stop string (which ends it), with any ending that
    could be the start of a stop string held back until the next text tells."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text to show now, whether a stop string was reached)."""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Row:
    """A running completion: its generator, its text so far, how many of its tokens the cache holds and its
    last `context` tokens (what it reads once it slides)."""

    def __init__(self, completion: Completion, tokenizer, device: torch.device, slot: int, context: int):
        self.completion = completion
        self.slot = slot  # its row of the KV cache; -1 once it slides
        self.cached = len(completion.prompt_ids)  # tokens of it in the cache (once prefilled)
        self.window = deque(completion.prompt_ids, maxlen=context)
        self.generated = 0
        self.last = 0  # the token to feed at the next decode step
        self.ended = False
        self.text = TextStream(tokenizer)
        self.stop = StopText(completion.stop)
        seed = completion.sampling.seed
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def push(self, token: int, end_id: int | None) -> Piece:
        """The piece that `token` adds; marks the row ended when it ends the completion (end_id)."""
        self.generated += 1
        self.last = token
        self.window.append(token)
        if token == end_id:
            return self.end("stop", "")
        shown, stopped = self.stop.push(self.text.push(token))
        if stopped:
            return self.end("stop", shown, flush=False)
        if self.generated >= self.completion.max_tokens:
            return self.end("length", shown)
        return Piece(shown)

    def end(self, reason: str, shown: str, flush: bool = True, tokens: int = 1) -> Piece:
        """The last piece: what was held back (an incomplete character, a possible stop string's start)."""
        self.ended = True
        if flush:
            more, stopped = self.stop.push(self.text.flush())
            shown += more if stopped else more + self.stop.flush()
            reason = "stop" if stopped else reason
        return Piece(shown, tokens, reason)


class BatchCache(KVCache):
    """The engine's KV cache: rows join and leave the running batch while the others decode (continuous batching).
    A view of some of its rows is a cache of its own for a forward of those rows alone."""

    def rows(self, start: int, stop: int, filled: int | None = None) -> BatchCache:
        """Rows [start, stop) as a cache of their own, sharing this one's memory. filled None: sharing the
        used-slot count too (a decode step of these rows advances every row); a number: a count of their
        own, from that slot (a prefill of new rows at the slots just before the others' next one)."""
        view = copy.copy(self)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.real = self.real[start:stop]
        if filled is not None:
            view.filled = torch.tensor(filled, dtype=torch.long, device=self.filled.device)
        return view

    def move_rows(self, sources: list[int], targets: list[int]) -> None:
        """Copy rows `sources` into rows `targets`, their slots as they are: rows that stay take the places
        of rows that left, with no repacking of the slots (realign does both, at a cost of every row)."""
        source = torch.tensor(sources, dtype=torch.long, device=self.real.device)
        target = torch.tensor(targets, dtype=torch.long, device=self.real.device)
        used = self.length
        for t in (*self.k, *self.v):
            t[target, :, :used] = t[source, :, :used]
        self.real[target] = self.real[source]

    def realign(self, rows: list[int], length: int) -> None:
        """Move `rows` (in that order) to rows 0, 1, ..., each row's real tokens right-aligned to end at slot
        `length`, which becomes the used-slot count; the other rows are emptied. Tokens keep their order and
        position ids, so a row continues as before: this drops the slots that rows which left, and the
        padding between them, took."""
        n = len(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.real.device)
        real = self.real.index_select(0, index)  # (n, size)
        counts = real.sum(1)
        if n and not int(counts.max()) <= length <= self.size:
            raise ValueError(f"cannot realign rows holding {int(counts.max())} tokens to {length} of {self.size} slots")
        real_first = torch.sort(real.to(torch.int8), dim=1, descending=True, stable=True).indices  # real slots, in order
        offset = torch.arange(length, device=index.device) - (length - counts)[:, None]  # (n, length): which real token
        source = real_first.gather(1, offset.clamp(min=0))  # (n, length): the slot it comes from
        for t in (*self.k, *self.v):
            t[:n, :, :length] = t[index[:, None], :, source].transpose(1, 2)  # (n, length, nh, hs) -> (n, nh, length, hs)
        self.real.zero_()
        self.real[:n, :length] = offset >= 0
        self.filled.fill_(length)


# A CPU computes a prompt's tokens at a fraction of a GPU's speed: there a step reads about one prompt, so
# that the running rows wait for one prefill at a time; a GPU reads a burst's prompts in a step or two.
AUTO_PREFILL_TOKENS = {"cuda": 2048, "cpu": 64}


class Engine:
    """Continuous batching over one model: submit() completions from an event loop; the engine's thread
    decodes every running row at each step and lets new completions in as rows free up."""

    def __init__(self, model: GPT, tokenizer, max_batch: int = 8, max_queue: int = 64, compile: bool | str = "auto",
                 prefill_tokens: int = 0):
        """prefill_tokens: the most prompt tokens that join at one step (one prompt at least), so that a
        burst of requests does not stall the running rows for long; 0: AUTO_PREFILL_TOKENS of the device."""
        if max_batch < 1 or max_queue < 0 or prefill_tokens < 0:
            raise ValueError(f"max_batch {max_batch} must be at least 1, max_queue {max_queue} and prefill_tokens "
                             f"{prefill_tokens} at least 0")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        param = next(model.parameters())
        self.device = param.device
        self.prefill_tokens = prefill_tokens or AUTO_PREFILL_TOKENS.get(self.device.type, AUTO_PREFILL_TOKENS["cpu"])
        self.block_size = model.config.block_size
        self.decoder = Decoder(model, compile=compile)
        # The whole context in every row: a row's tokens never need more slots than block_size.
        try:
            self.cache = BatchCache(model.config, max_batch, self.block_size, param.device, param.dtype)
        except (RuntimeError, MemoryError):  # torch's out-of-memory errors are RuntimeErrors
            size = kv_cache_elements(model.config, max_batch, self.block_size) * param.element_size()
            raise UsageError(f"the KV cache of --max-batch {max_batch} rows of {self.block_size} tokens needs "
                             f"{size / 2**30:,.1f} GiB, which {param.device} cannot hold; lower --max-batch") from None
        self.rows: list[Row] = []  # running in the cache, rows[i] in cache row i once realigned
        self.sliding: list[Row] = []  # running past the context: out of the cache, each step reads its window
        self.waiting: deque[Completion] = deque()
        self.joining: list[Completion] = []  # admitted at this step, not yet prefilled
        self.rows_left = False  # since the last realign: the running rows are no longer rows 0..n-1
        self.wakeup = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.draining = False  # submit refuses (Draining); the loop wakes drain() after each step
        self.cutting = False  # drain's grace is over: the next step ends every completion held
        self.failure: str | None = None  # why the engine stopped for good (its thread has ended); None: it runs
        self.steps = 0  # forwards run (decode steps and prefills)
        # Sampling stays within the tokenizer's ids (the model's vocabulary may be padded beyond them).
        self.vocab = min(tokenizer.vocab_size, model.config.vocab_size)

    # ------------------------------------------------------------------ the server's side

    @property
    def context(self) -> int:
        return self.block_size

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.sliding)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def capacity(self) -> int:
        """Completions the engine takes at once: every row, and every waiting place."""
        return self.max_batch + self.max_queue

    def submit(self, completions: list[Completion]) -> None:
        """Queue completions (all or none); QueueFull when more than max_queue would wait for a row. A prompt
        holds 1 to block_size tokens (the app crops a longer one); max_tokens may take a row past the context."""
        for c in completions:
            if not 0 < len(c.prompt_ids) <= self.block_size or c.max_tokens < 1:
                raise ValueError(f"a prompt of {len(c.prompt_ids)} tokens (1 to the context's {self.block_size}) or "
                                 f"max_tokens {c.max_tokens} (at least 1) is out of range")
        with self.wakeup:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            if self.draining:
                raise Draining("the server is stopping")
            self.drop_cancelled_waiting()
            free = self.max_batch - self.running - len(self.joining)
            if len(self.waiting) + len(completions) > max(free, 0) + self.max_queue:
                raise QueueFull(f"{len(self.waiting)} completion(s) wait and {len(completions)} more do not fit: "
                                f"{max(free, 0)} free row(s) and {self.max_queue} waiting place(s) take at most "
                                f"{max(free, 0) + self.max_queue}")
            self.waiting.extend(completions)
            self.wakeup.notify_all()  # all: drain() may wait on the same condition as the loop

    def start(self) -> Engine:
        self.thread = threading.Thread(target=self.run, name="gpt2train-engine", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify_all()
        if self.thread is not None:
            self.thread.join()

    def drain(self, grace_seconds: float) -> None:
        """Take no new completions; wait up to grace_seconds (or until cut() is called) for those held, running or
        waiting, to end; then cut those still held. Blocks until the engine holds nothing: call it from a thread
        of its own, not from an event loop."""
        with self.wakeup:
            self.draining = True
            self.wakeup.wait_for(lambda: self.cutting or self.drained(), timeout=grace_seconds)
        self.cut()
        with self.wakeup:
            self.wakeup.wait_for(self.drained)

    def cut(self) -> None:
        """End every completion held at the next step's start, each with a last piece, finish_reason "cut"."""
        with self.wakeup:
            self.cutting = True
            self.wakeup.notify_all()

    def drained(self) -> bool:
        """Nothing is held, or nothing will run any more (the engine stopped, or failed for good)."""
        held = self.rows or self.sliding or self.joining or self.waiting
        return self.stopping or self.failure is not None or not held

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """The engine's thread. Should a failed step's cleanup fail too, the engine stops for good rather than
        end silently: what it holds ends with an error, and submit refuses from then on (nothing hangs)."""
        try:
            with torch.no_grad():  # per thread: the server's threads' setting does not reach this one
                self.loop()
        except Exception as e:  # noqa: BLE001 -- reported to every completion, held or to come
            self.stop_for_good(one_line(e))

    def loop(self) -> None:
        while True:
            with self.wakeup:
                if self.draining:
                    self.wakeup.notify_all()  # a step is over: drain() looks again at what is held
                while not (self.running or self.waiting or self.stopping):
                    self.wakeup.wait()
                if self.stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 -- end the completions it touched; keep serving the next ones
                self.fail_all(one_line(e))

    def step(self) -> None:
        if self.cutting:
            return self.cut_all()
        self.drop_ended(cancelled=True)  # cancelled since the last step
        self.drop_cancelled_waiting()
        self.slide_full_rows()
        new = self.admit()
        self.make_room([c for c in new if self.fits_cache(c)])
        running = len(self.rows)
        if new:  # first, and out at once: a new completion's first token waits for no other forward
            self.finish(self.prefill(new))
        if running:
            self.finish(self.decode(running))
        if self.sliding:
            self.finish(self.slide())

    def fits_cache(self, completion: Completion) -> bool:
        """Whether its prompt leaves the cache room for the token after it; one that fills the context slides."""
        return len(completion.prompt_ids) < self.block_size

    def finish(self, produced: list[tuple[Row, Piece]]) -> None:
        self.drop_ended()  # rows that ended leave before their last piece is out
        self.deliver([(row.completion, piece) for row, piece in produced])

    def cut_all(self) -> None:
        """drain's grace is over: every completion held ends now, a running one with the text it held back."""
        with self.wakeup:
            rows, waiting = self.rows + self.sliding, list(self.waiting)
            self.rows, self.sliding = [], []
            self.waiting.clear()
        self.cache.realign([], 0)
        self.deliver([(row.completion, row.end("cut", "", tokens=0)) for row in rows]
                     + [(c, Piece("", 0, "cut")) for c in waiting])

    def drop_ended(self, cancelled: bool = False) -> None:
        """Rows whose completion ended (and, at a step's start, was cancelled) leave; the last rows move into
        their places at the next step. Within a step only new rows can end before the decode, and they come
        after the running ones it takes."""
        def stays(row: Row) -> bool:
            return not (row.ended or (cancelled and row.completion.cancelled))

        kept = [r for r in self.rows if stays(r)]
        self.rows_left |= len(kept) < len(self.rows)
        self.rows = kept
        self.sliding = [r for r in self.sliding if stays(r)]

    def slide_full_rows(self) -> None:
        """Rows whose tokens fill the context leave the cache (their next token would need a position past it)
        and slide from now on; the last rows move into their places as into those of rows that ended."""
        full = [r for r in self.rows if r.cached >= self.block_size]
        if not full:
            return
        for row in full:
            row.slot = -1
        with self.wakeup:  # one change for submit's count of taken rows
            self.rows = [r for r in self.rows if r.slot >= 0]
            self.sliding += full
        self.rows_left = True

    def drop_cancelled_waiting(self) -> None:
        """Completions whose client left while they waited leave the queue now, not when a row frees: until
        then they would hold waiting places (refusing others with QueueFull) and count in the queue depth."""
        with self.wakeup:
            if any(c.cancelled for c in self.waiting):
                self.waiting = deque(c for c in self.waiting if not c.cancelled)

    def admit(self) -> list[Completion]:
        """Waiting completions for the free rows, their prompts up to prefill_tokens in all (one at least);
        they are `joining` until their prefill puts them in rows (submit counts their rows as taken)."""
        with self.wakeup:
            new, tokens = [], 0
            while self.waiting and self.running + len(new) < self.max_batch:
                if new and tokens + len(self.waiting[0].prompt_ids) > self.prefill_tokens:
                    break
                completion = self.waiting.popleft()
                if not completion.cancelled:
                    new.append(completion)
                    tokens += len(completion.prompt_ids)
            self.joining = new
            return new

    def make_room(self, new: list[Completion]) -> None:
        """The running rows in cache rows 0..n-1 (the last ones moved into the places of rows that left),
        and slots for this step: the new prompts end just before the slot the decode step writes. The
        slots are repacked (realign) only when that slot is past the cache, the new prompts have no room
        before it, or the slots in use exceed the longest row by more than a quarter (a decode step reads
        them all)."""
        longest_prompt = max((len(c.prompt_ids) for c in new), default=0)
        if not self.rows:
            self.cache.realign([], longest_prompt)
            self.rows_left = False
            return
        if self.rows_left:
            self.fill_holes()
        longest = max(r.cached for r in self.rows)
        need = max(longest, longest_prompt)
        used = self.cache.length
        if used < need or used + 1 > self.cache.size or used > longest + longest // 4:
            self.cache.realign([r.slot for r in self.rows], need)
            for i, row in enumerate(self.rows):
                row.slot = i

    def fill_holes(self) -> None:
        """Rows past the running count move into the rows that left (a copy of those rows alone)."""
        n = len(self.rows)
        holes = sorted(set(range(n)) - {r.slot for r in self.rows})
        movers = sorted((r for r in self.rows if r.slot >= n), key=lambda r: r.slot)
        if movers:
            self.cache.move_rows([r.slot for r in movers], holes)
            for row, hole in zip(movers, holes):
                row.slot = hole
            self.rows.sort(key=lambda r: r.slot)
        self.rows_left = False

    def decode(self, n: int) -> list[tuple[Row, Piece]]:
        """One step of the first n rows (those running before this step's new ones): each feeds its last token."""
        rows = self.rows[:n]
        ids = [r.last for r in rows]
        compiled = self.decoder.compiled is not None
        if compiled:  # one shape for every step: all rows
            ids += [0] * (self.max_batch - n)
            cache = self.cache
        else:
            cache = self.cache.rows(0, n)
        logits = self.decoder(torch.tensor(ids, device=self.device)[:, None], cache)[:n]
        if compiled:  # the other rows fed a token that is not theirs: hidden again
            self.cache.real[n:, self.cache.length - 1] = False
        self.steps += 1
        for row in rows:
            row.cached += 1
        return self.emit(rows, logits)

    def prefill(self, new: list[Completion]) -> list[tuple[Row, Piece]]:
        """The new completions' prompts into the next free rows, ending just before the decode step's slot;
        those that fill the context join the sliding rows, their first token still to come (slide)."""
        first = len(self.rows)
        cached = [c for c in new if self.fits_cache(c)]
        rows = [Row(c, self.tokenizer, self.device, first + i, self.block_size) for i, c in enumerate(cached)]
        full = [Row(c, self.tokenizer, self.device, -1, self.block_size) for c in new if not self.fits_cache(c)]
        if cached:
            tokens, real = left_padded([c.prompt_ids for c in cached], self.block_size, None, self.device)
            self.cache.real[first:first + len(cached)] = False  # a former row's tokens, if any
            view = self.cache.rows(first, first + len(cached), filled=self.cache.length - tokens.size(1))
            logits = self.decoder.prefill(tokens, real, view)
            self.steps += 1
        with self.wakeup:  # one change for submit's count of taken rows
            self.rows += rows
            self.sliding += full
            self.joining = []
        return self.emit(rows, logits) if cached else []

    def slide(self) -> list[tuple[Row, Piece]]:
        """One step of the sliding rows: a forward of each one's last block_size tokens, afresh (as `sample`
        goes on past the context: generation.Decoder.slide); all of them in one batch, every window full."""
        rows = self.sliding
        window = torch.tensor([list(r.window) for r in rows], device=self.device)
        logits = self.decoder.slide(window, torch.ones_like(window, dtype=torch.bool))
        self.steps += 1
        return self.emit(rows, logits)

    def emit(self, rows: list[Row], logits: torch.Tensor) -> list[tuple[Row, Piece]]:
        """Each row's next token (greedy rows together, sampling rows each with its generator) and piece."""
        logits = logits[:, :self.vocab]
        tokens = logits.argmax(-1).tolist()
        for i, row in enumerate(rows):
            s = row.completion.sampling
            if s.temperature > 0:
                tokens[i] = int(sample_next(logits[i:i + 1], s.temperature, s.top_k, s.top_p, row.generator))
        eot_id = getattr(self.tokenizer, "eot_id", None)
        return [(row, row.push(token, eot_id if row.completion.end_id is None else row.completion.end_id))
                for row, token in zip(rows, tokens)]

    def deliver(self, produced: list[tuple[Completion, Piece]]) -> None:
        """Each request's pieces in one hand-over to its event loop (not one per token)."""
        by_inbox: dict[Inbox, list[tuple[int, Piece]]] = {}
        for completion, piece in produced:
            completion.finished |= piece.finish_reason is not None
            if not completion.cancelled:
                by_inbox.setdefault(completion.inbox, []).append((completion.index, piece))
        for inbox, items in by_inbox.items():
            try:
                inbox.put(items)
            except RuntimeError:  # its event loop is closed: nobody reads these any more
                for completion, _ in produced:
                    if completion.inbox is inbox:
                        completion.cancel()

    def fail_all(self, reason: str) -> None:
        """A step failed: every running and waiting completion ends with an error piece; the cache starts empty."""
        self.cache.realign([], 0)  # first: should it fail, run() stops the engine, which ends them all alike
        self.end_with_error(self.take_unfinished(), f"the engine failed: {reason}")

    def stop_for_good(self, reason: str) -> None:
        with self.wakeup:
            self.failure = reason  # submit refuses from here on: no completion waits for a thread that is gone
        self.end_with_error(self.take_unfinished(), str(EngineStopped(reason)))

    def take_unfinished(self) -> list[Completion]:
        """Every completion the engine holds, off its rows and queue, less those whose last piece is out (a new
        row may have ended at the step's prefill before its decode failed)."""
        with self.wakeup:
            held = [r.completion for r in self.rows + self.sliding] + self.joining + list(self.waiting)
            self.rows, self.sliding, self.joining = [], [], []
            self.waiting.clear()
        return [c for c in held if not c.finished]

    def end_with_error(self, completions: list[Completion], message: str) -> None:
        self.deliver([(c, Piece(message, 0, "error")) for c in completions])
