"""LaTeX in paper text as a reader sees it on a page without a TeX renderer: `\\textbf{X}` is X,
`$\\alpha^2$` is α², `\\cite{..}` is gone, `--` is a dash. arXiv titles and abstracts carry
LaTeX as typed, and the digest's pages showed it raw (issue 19).

Plain text in, plain text out: the templates still escape the result. What has no plain-text
form (a fraction, an unknown macro) is shown with its braces and backslash removed, which reads
better than the source and loses nothing a reader of a digest needs."""

from __future__ import annotations

import re
import unicodedata

# Commands whose braced argument is the text: fonts, boxes, math alphabets.
_KEEP_ARGUMENT = frozenset(
    "textbf textit emph texttt textsc textrm textsf textup textnormal text mbox underline "
    "mathrm mathbf mathit mathcal mathbb mathsf mathtt mathfrak boldsymbol operatorname bm "
    "url hbox".split()
)
# Commands dropped with their argument: references that mean nothing outside the paper.
_DROP_ARGUMENT = frozenset("cite citep citet ref eqref label footnote".split())
_SYMBOLS = {
    # Greek
    **{name: chr(code) for name, code in (
        ("alpha", 0x3B1), ("beta", 0x3B2), ("gamma", 0x3B3), ("delta", 0x3B4),
        ("epsilon", 0x3B5), ("varepsilon", 0x3B5), ("zeta", 0x3B6), ("eta", 0x3B7),
        ("theta", 0x3B8), ("vartheta", 0x3D1), ("iota", 0x3B9), ("kappa", 0x3BA),
        ("lambda", 0x3BB), ("mu", 0x3BC), ("nu", 0x3BD), ("xi", 0x3BE), ("pi", 0x3C0),
        ("rho", 0x3C1), ("sigma", 0x3C3), ("tau", 0x3C4), ("upsilon", 0x3C5), ("phi", 0x3C6),
        ("varphi", 0x3C6), ("chi", 0x3C7), ("psi", 0x3C8), ("omega", 0x3C9),
        ("Gamma", 0x393), ("Delta", 0x394), ("Theta", 0x398), ("Lambda", 0x39B),
        ("Xi", 0x39E), ("Pi", 0x3A0), ("Sigma", 0x3A3), ("Phi", 0x3A6), ("Psi", 0x3A8),
        ("Omega", 0x3A9),
    )},  # fmt: skip
    "times": "×", "cdot": "·", "pm": "±", "mp": "∓", "div": "÷", "leq": "≤", "le": "≤",
    "geq": "≥", "ge": "≥", "neq": "≠", "ne": "≠", "approx": "≈", "sim": "~", "simeq": "≃",
    "equiv": "≡", "propto": "∝", "infty": "∞", "partial": "∂", "nabla": "∇", "sum": "Σ",
    "prod": "Π", "int": "∫", "in": "∈", "notin": "∉", "subset": "⊂", "subseteq": "⊆",
    "cup": "∪", "cap": "∩", "forall": "∀", "exists": "∃", "emptyset": "∅", "ell": "ℓ",
    "to": "→", "rightarrow": "→", "leftarrow": "←", "Rightarrow": "⇒", "Leftarrow": "⇐",
    "leftrightarrow": "↔", "mapsto": "↦", "uparrow": "↑", "downarrow": "↓",
    "ldots": "…", "dots": "…", "cdots": "⋯", "star": "⋆", "circ": "∘", "dagger": "†",
    "mid": "|", "vert": "|", "lvert": "|", "rvert": "|", "langle": "⟨", "rangle": "⟩",
    "ll": "≪", "gg": "≫", "log": "log", "exp": "exp", "max": "max", "min": "min",
    "arg": "arg", "quad": " ", "qquad": " ", "textasciitilde": "~", "S": "§", "%": "%",
    "&": "&", "_": "_", "#": "#", "$": "$", "{": "{", "}": "}", ",": " ", ";": " ",
    " ": " ", "!": "", "\\": " ", "LaTeX": "LaTeX", "TeX": "TeX",
    "left": "", "right": "", "big": "", "Big": "", "bigl": "", "bigr": "",
    "displaystyle": "", "textstyle": "", "noindent": "", "newline": " ",
}  # fmt: skip
# \'e \"o \`a \^o \~n \=a \.z \u{g} \v{s} \H{o} \c{c}: the letter with its combining mark.
_ACCENTS = {
    "'": "\u0301", '"': "\u0308", "`": "\u0300", "^": "\u0302", "~": "\u0303", "=": "\u0304",
    ".": "\u0307", "u": "\u0306", "v": "\u030c", "H": "\u030b", "c": "\u0327", "k": "\u0328",
}  # fmt: skip
_SUPER = str.maketrans("0123456789+-=()niT*", "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱᵀ*")
_SUB = str.maketrans("0123456789+-=()aeiojkmnprstx", "₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑᵢₒⱼₖₘₙₚᵣₛₜₓ")
_SUPER_OK = set("0123456789+-=()niT*")
_SUB_OK = set("0123456789+-=()aeiojkmnprstx")

_GROUP = r"\{((?:[^{}]|\{[^{}]*\})*)\}"  # a braced argument, one level of nesting inside
_ACCENT = re.compile(r"\{?\\([`'^\"~=.]|[uvHck](?=[{\s]))\s*\{?\\?([A-Za-z])\}?\}?")
_COMMAND_WITH_GROUP = re.compile(r"\\([A-Za-z]+)\*?\s*" + _GROUP)
_FRAC = re.compile(r"\\[dt]?frac\s*" + _GROUP + r"\s*" + _GROUP)
_SQRT = re.compile(r"\\sqrt\s*" + _GROUP)
_HREF = re.compile(r"\\href\s*" + _GROUP + r"\s*" + _GROUP)
_COMMAND = re.compile(r"\\([A-Za-z]+|[^A-Za-z\s])")
_MATH = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$((?:\\.|[^$\\])+?)\$", re.DOTALL)
_SCRIPT = re.compile(r"([\^_])\s*(?:" + _GROUP + r"|(\\[A-Za-z]+|[^\s{}\\]))")
_BRACE = re.compile(r"(?<!\\)[{}]")
# A reference with the space before it: "as shown \cite{x}." is "as shown."
_REFERENCE = re.compile(r"\s*\\(?:" + "|".join(sorted(_DROP_ARGUMENT)) + r")\*?\s*\{[^{}]*\}")


def latex_to_text(text: str) -> str:
    if not any(c in text for c in "\\$~{}`'-"):
        return text
    text = _REFERENCE.sub("", text)
    text = _MATH.sub(lambda m: _math(m.group(1) or m.group(2)), text)
    text = _prose(text)
    return " ".join(text.split())


def _math(body: str) -> str:
    body = _FRAC.sub(lambda m: f"{_operand(m.group(1))}/{_operand(m.group(2))}", body)
    body = _SQRT.sub(lambda m: f"√({_math(m.group(1))})", body)
    body = _SCRIPT.sub(_script, body)
    body = body.replace("~", " ")
    return _commands(body)


def _operand(group: str) -> str:
    text = _math(group).strip()
    return text if text.isalnum() else f"({text})"


def _script(match: re.Match[str]) -> str:
    mark, group, single = match.group(1), match.group(2), match.group(3)
    inner = _commands(group if group is not None else single)
    table, ok = (_SUPER, _SUPER_OK) if mark == "^" else (_SUB, _SUB_OK)
    if inner and set(inner) <= ok:
        return inner.translate(table)
    # V_{0.5} as V_0.5: parentheses only where the script has several words.
    return f"{mark}({inner})" if " " in inner.strip() else f"{mark}{inner.strip()}"


def _prose(text: str) -> str:
    text = text.replace("---", "—").replace("--", "–").replace("``", "“").replace("''", "”")
    text = re.sub(r"(?<!\\)~", "\u00a0", text)
    return _commands(text)


def _commands(text: str) -> str:
    text = _ACCENT.sub(_accent, text)
    text = _HREF.sub(lambda m: m.group(2), text)
    previous = None
    while previous != text:  # \textbf{\emph{x}}: inner groups first, a few rounds at most
        previous = text
        text = _COMMAND_WITH_GROUP.sub(_with_group, text)
    text = _COMMAND.sub(lambda m: _SYMBOLS.get(m.group(1), m.group(1)), text)
    return _BRACE.sub("", text)


def _accent(match: re.Match[str]) -> str:
    return unicodedata.normalize("NFC", match.group(2) + _ACCENTS[match.group(1)])


def _with_group(match: re.Match[str]) -> str:
    name, argument = match.group(1), match.group(2)
    if name in _DROP_ARGUMENT:
        return ""
    if name in _KEEP_ARGUMENT:
        return argument
    if name in _SYMBOLS:  # \hat{x}-like commands we do not know: the symbol, then its argument
        return _SYMBOLS[name] + argument
    return argument  # an unknown macro: its text is the best guess
