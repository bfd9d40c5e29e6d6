"""`TextTracker`: a request's text as tokens arrive, with stop strings cut off and nothing streamed too early."""

from __future__ import annotations


class TextTracker:
    """Decodes a request's generated tokens and watches for stop strings.

    `visible` is the text safe to show: it never ends in an incomplete character, and while the request runs it
    holds back a tail that could still become a stop string. `stopped` tells that a stop string appeared; the text
    then ends just before it.

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

    ```
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.visible = ""
        self.stopped = False

    def update(self, token_ids: list[int]) -> None:
        if self.stopped:
            return
        text = self._decode_until_stop(token_ids)
        if self.stopped:
            self.visible = text
            return
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its next token
            text = text.rstrip("\ufffd")
        safe = text[: len(text) - self._holdback] if self._holdback else text
        if len(safe) > len(self.visible) and safe.startswith(self.visible):
            self.visible = safe

    def finish(self, token_ids: list[int]) -> None:
        """The request ended: show everything (up to a stop string). Text that cannot be decoded (the request failed
        on it) stays as last shown."""
        if not self.stopped:
            try:
                self.visible = self._decode_until_stop(token_ids)
            except Exception:
                return

    def _decode_until_stop(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, cut before the first stop string (which sets `stopped`)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=None)
        if cut is None:
            return text
        self.stopped = True
        return text[:cut]
