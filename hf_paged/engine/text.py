"""`TextTracker`: a request's text as tokens arrive, with stop strings cut off and nothing streamed too early."""

from __future__ import annotations


class TextTracker:
    """Decodes a request's generated tokens and watches for stop strings.

    `visible` is the text safe to show: it never ends in an incomplete character, and while the request runs it
    holds back only the end of the text that could still become a stop string (the longest end that begins one,
    or, early on, what continues one begun in the prompt), so streamed text keeps pace with its tokens. `stopped`
    tells that a stop string appeared; the text then ends just before it. A stop string may begin in the prompt
    (`prompt_ids`) and end in the output, as with `generate`'s `stop_strings`; the text is then empty.

    Example:

    ```python
    >>> class Letters:  # a tokenizer whose token i is the letter chr(97 + i)
    ...     def decode(self, ids, skip_special_tokens=True):
    ...         return "".join(chr(97 + i) for i in ids)
    >>> tracker = TextTracker(Letters(), stop=("cd",))
    >>> tracker.update([0, 1, 2]); tracker.visible, tracker.stopped
    ('ab', False)
    >>> tracker.update([0, 1, 2, 3]); tracker.visible, tracker.stopped
    ('ab', True)
    >>> tracker = TextTracker(Letters(), stop=("cd",))
    >>> tracker.update([0, 1]); tracker.visible  # no end of "ab" begins "cd": nothing is held back
    'ab'

    ```
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), prompt_ids: list[int] | tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        longest = max((len(s) for s in stop), default=1)
        self._holdback = longest - 1
        # the prompt's last tokens: a stop string may begin in the prompt and end in the output, as `generate`'s
        # stop strings do (they watch the whole sequence)
        self._prompt_tail = list(prompt_ids[-(2 * longest + 8) :]) if stop else []
        self.visible = ""
        self.stopped = False
        # incremental decoding: `_text` is the text of the first `_read` tokens (whole characters); the next piece
        # is what decoding from `_prefix` adds to the text of tokens `_prefix:_read` (the context a tokenizer needs,
        # e.g. for a word's leading space), so each step decodes a few tokens, not the whole output
        self._text = ""
        self._prefix = 0
        self._read = 0

    def update(self, token_ids: list[int]) -> None:
        if self.stopped:
            return
        text = self._extend(token_ids)
        if self.stopped:
            self.visible = text
            return
        held = self._stop_prefix_length(text)
        if self._prompt_tail and held < len(text) < self._holdback and self._stop_begun_in_prompt(token_ids):
            held = len(text)  # a stop string begun in the prompt may still end in the output's next characters
        safe = text[: len(text) - held]
        if len(safe) > len(self.visible) and safe.startswith(self.visible):
            self.visible = safe

    def _stop_prefix_length(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string: all that must be held back, since
        only it could still become one (a stop string found in `text` already cut it)."""
        for length in range(min(self._holdback, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _stop_begun_in_prompt(self, token_ids: list[int]) -> bool:
        """Whether a stop string begins in the prompt's text and every character after its start, up to the end of
        the output's text so far, matches it (decoded together, as in `_stop_across_prompt_end`)."""
        head = self.tokenizer.decode(self._prompt_tail, skip_special_tokens=True)
        joint = self.tokenizer.decode(self._prompt_tail + list(token_ids), skip_special_tokens=True)
        if not joint.startswith(head):
            return True  # cannot tell where the output begins: hold it back, as before the stop strings are known
        for stop in self.stop:
            for start in range(max(0, len(head) - len(stop) + 1), len(head)):
                if stop.startswith(joint[start:]):
                    return True
        return False

    def finish(self, token_ids: list[int]) -> None:
        """The request ended: show everything (up to a stop string), an incomplete last character included. Text
        that cannot be decoded (the request failed on it) stays as last shown."""
        if not self.stopped:
            try:
                self.visible = self._extend(token_ids, final=True)
            except Exception:
                return

    def _extend(self, token_ids: list[int], final: bool = False) -> str:
        """The text of `token_ids` (which extend the tokens seen before), cut before the first stop string (which
        sets `stopped`); a stop string that begins in the prompt leaves no text. A trailing incomplete character
        waits for its next token unless `final`."""
        if len(token_ids) < self._read:  # not an extension: start over
            self._text, self._prefix, self._read = "", 0, 0
        decode = self.tokenizer.decode
        context = decode(token_ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(token_ids[self._prefix :], skip_special_tokens=True)
        searched_from = len(self._text)
        if len(window) > len(context) and (final or not window.endswith("\ufffd")):
            self._text += window[len(context) :]
            self._prefix, self._read = self._read, len(token_ids)
        text = self._text
        first = max(0, searched_from - self._holdback)
        cut = min((i for i in (text.find(s, first) for s in self.stop) if i >= 0), default=None)
        if cut is None and self._prompt_tail and searched_from < self._holdback:
            # a stop string begun in the prompt ends within the output's first `_holdback` characters, so it shows
            # in an update whose text started shorter than that
            cut = 0 if self._stop_across_prompt_end(token_ids) else None
        if cut is None:
            return text
        self.stopped = True
        return text[:cut]

    def _stop_across_prompt_end(self, token_ids: list[int]) -> bool:
        """Whether a stop string begins in the prompt's text and ends in the output's (decoded together, so that
        tokenizers which drop a leading space on their own see it)."""
        head = self.tokenizer.decode(self._prompt_tail, skip_special_tokens=True)
        joint = self.tokenizer.decode(self._prompt_tail + list(token_ids), skip_special_tokens=True)
        if not joint.startswith(head):
            return False
        for stop in self.stop:
            start = joint.find(stop, max(0, len(head) - len(stop) + 1))
            if 0 <= start < len(head) < start + len(stop):
                return True
        return False
