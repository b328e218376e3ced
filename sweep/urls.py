"""Storage URLs: what may be printed of them, and where a SQLite one's file is. Light on purpose (no Optuna, no
SQLAlchemy), so commands that only print can use it.

A password may sit in a URL in several places, and every one is masked: the userinfo (`user:pw@host`, also with an
unescaped `@` in the password, `user:p@ss@host`, and percent-encoded), and the query string (`?password=pw`, which
libpq accepts, as do `sslpassword` and friends). A libpq `key=value` string is masked the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, unquote_plus

__all__ = ["MASK", "SQLITE_URL", "mask_url", "mask_urls", "plain_folder_name", "redact", "sqlite_path", "sqlite_url",
           "url_secrets"]

MASK = "***"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)(.*)", re.S)
# A `key=value` pair of a query string or a libpq connection string; a value may be single-quoted (libpq).
_PAIR = re.compile(r"(?P<lead>^|[?&;\s])(?P<key>[^=&?;#\s]+)=(?P<value>'(?:[^'\\]|\\.)*'|[^&;#\s]*)")
_SECRET_WORDS = ("pass", "pwd", "secret", "token", "credential")
# A scheme is matched from the start of its run of scheme characters only (the lookbehind; a run's leading digits are
# skipped as `lead`): tried from every letter, a long word was rescanned from each, and a 200 kB value in an error line
# took minutes (the time grows with the square of the length).
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.\-])(?P<lead>[0-9+.\-]*)(?P<url>[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*)")
# A URL given where a path was expected, its `//` collapsed to `/` as a path's are: `postgresql:/me:pw@host/db`: in
# a word (`_WORD`) that holds an `@`, the first such head before its last `@`, and everything from it up to that `@`.
_WORD = re.compile(r"[^\s'\"<>]+")
_COLLAPSED_HEAD = re.compile(r"(?<![A-Za-z0-9+.\-])[0-9+.\-]*[A-Za-z][A-Za-z0-9+.\-]*:/(?!/)[^\s'\"<>/:@]*:")


def _is_secret_key(key: str) -> bool:
    name = unquote_plus(key).lower()
    return any(word in name for word in _SECRET_WORDS)


def _userinfo_end(rest: str) -> int:
    """Where the userinfo ends (the index of its `@`), or -1. The last `@` counts, not the first: a password may hold
    an unescaped `@` (`user:p@ss@host`). A URL whose text after `//` starts with `/` (SQLite's) has no userinfo."""
    return -1 if rest.startswith("/") else rest.rfind("@")


def mask_url(url: str) -> str:
    """The URL with every password in it replaced by ***, for anything printed or stored: the userinfo's password
    (everything between the first `:` and the last `@`) and the value of every query or `key=value` pair whose key
    names a secret (password, sslpassword, passfile, token, ...). Masks too much rather than too little: a query
    string holding an `@` hides the host too."""
    match = _SCHEME.match(url)
    if match is not None:
        scheme, rest = match.groups()
        end = _userinfo_end(rest)
        if end >= 0:
            user, colon, _ = rest[:end].partition(":")
            rest = (f"{user}:{MASK}" if colon else user) + rest[end:]
        url = scheme + _mask_query(rest)
    return _PAIR.sub(_mask_pair, url)


def _query_pairs(rest: str) -> list[tuple[str, str]]:
    """The `key=value` pairs of a URL's query string as SQLAlchemy reads them: split at `&` only, so a value runs to
    the next `&` whatever it holds (`#`, `;`, a space: all the password's, passed to the driver as they stand)."""
    _, mark, query = rest.partition("?")
    return [(key, value) for key, sep, value in (pair.partition("=") for pair in query.split("&")) if sep] \
        if mark else []


def _masked_already(value: str) -> bool:
    """A value masked before, as a URL in a sentence ends: `password=***: connection refused` keeps its colon."""
    return re.fullmatch(rf"{re.escape(MASK)}[:.,;)\]]*", value) is not None


def _mask_query(rest: str) -> str:
    head, mark, query = rest.partition("?")
    if not mark:
        return rest
    pairs = [(key, sep, MASK if sep and _is_secret_key(key) and not _masked_already(value) else value)
             for key, sep, value in (pair.partition("=") for pair in query.split("&"))]
    return head + mark + "&".join(key + sep + value for key, sep, value in pairs)


def _mask_pair(match: re.Match[str]) -> str:
    if not _is_secret_key(match["key"]) or _masked_already(match["value"]):
        return match[0]
    return f"{match['lead']}{match['key']}={MASK}"


def mask_urls(text: str) -> str:
    """Free text (a stored failure reason, a driver's message) with every URL in it masked (`mask_url`), and every
    `password=...` pair outside them too, when the URL it came from is not known; also a URL that was taken for a
    path (`postgresql:/me:pw@host/db`)."""
    text = _URL_IN_TEXT.sub(lambda match: match["lead"] + mask_url(match["url"]), text)
    return _PAIR.sub(_mask_pair, _WORD.sub(_mask_collapsed, text) if "@" in text else text)


def _mask_collapsed(word: re.Match[str]) -> str:
    """A word of free text with the userinfo of a collapsed URL in it masked, up to the word's last `@` (in time
    linear in the word's length: each `@` is found once, and a head is searched for once, before the last)."""
    text = word[0]
    last = text.rfind("@")
    head = _COLLAPSED_HEAD.search(text, 0, last) if last > 0 else None
    return text if head is None else text[:head.end()] + MASK + text[last:]


def url_secrets(url: str) -> list[str]:
    """The secrets a URL holds, as written and percent-decoded, longest first: what must never appear in text that
    also shows the URL (a driver's error message may quote a mis-parsed host that holds a password's tail)."""
    found: list[str] = []
    match = _SCHEME.match(url)
    rest = match.group(2) if match is not None else ""
    end = _userinfo_end(rest) if match is not None else -1
    if end >= 0:
        _, colon, password = rest[:end].partition(":")
        if colon:
            found.append(password)
            # What a parser that ends the userinfo at the first `@` takes for the host: the password's tails.
            found += [password[i + 1:] for i, char in enumerate(password) if char == "@"]
    for pair in _PAIR.finditer(url):
        if _is_secret_key(pair["key"]):
            found.append(pair["value"].strip("'"))
    found += [value for key, value in _query_pairs(rest) if _is_secret_key(key)]  # all of it, as the driver takes it
    secrets = {form for secret in found for form in (secret, unquote(secret), unquote_plus(secret)) if form}
    return sorted(secrets, key=len, reverse=True)


def redact(text: str, url: str) -> str:
    """`text` (an error message, a log line) with `url` masked and each of its secrets replaced by *** where it
    stands alone (not inside a longer word: a password's tail `ss` is not hidden in `address`)."""
    text = text.replace(url, mask_url(url))
    for secret in url_secrets(url):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, text)
    return text


# A SQLite URL, with or without its driver's name (`sqlite+pysqlite:///`), and its file's path (not `:memory:`).
SQLITE_URL = re.compile(r"(?P<scheme>sqlite(?:\+\w+)?:///)(?P<path>(?!:memory:(?:\?|$))[^?]+)"
                        r"(?P<query>(?:\?.*)?)", re.S)


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///` URL (or `sqlite+DRIVER:///`; a query string is not the file's), or None
    for anything else (a server's URL, an in-memory database)."""
    found = SQLITE_URL.fullmatch(url)
    return None if found is None else Path(unquote(found["path"]))  # decoded, as SQLAlchemy opens it


def sqlite_url(path: str | Path, like: str | None = None) -> str:
    """The `sqlite:///` URL of the file `path` (with the driver and the query of the SQLite URL `like`, when given).
    SQLAlchemy decodes `%XX` in a URL's path and ends it at a `?`: a folder named `exp%41` or `a?b` would otherwise
    put the database in `expA` or open `a`."""
    found = None if like is None else SQLITE_URL.fullmatch(like)
    return ("sqlite:///" if found is None else found["scheme"]) + str(path).replace("%", "%25").replace("?", "%3F") + (
        "" if found is None else found["query"])


def expand_home(url: str) -> str:
    """A `sqlite:///~/x.db` (or `~user/`) URL with its home folder spelled out, as a checkpoint store's `~/ckpts` is;
    any other URL as it is. SQLAlchemy would open a folder named `~` in the working folder."""
    found = SQLITE_URL.fullmatch(url)
    if found is None or not found["path"].startswith("~"):
        return url
    home = os.path.expanduser(unquote(found["path"]))
    return url if home.startswith("~") else sqlite_url(home, like=url)


def plain_folder_name(name: str) -> bool:
    """Whether a study's name is one plain path segment, a folder of its own under a store or a tracking root: not
    empty, `.` or `..`, and holding no slash (the folder would lie elsewhere)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
