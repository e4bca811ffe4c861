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
# Commands dropped with their argument that are not references: environments' names.
_DROP_WITH_ARGUMENT = frozenset("begin end vspace hspace".split())
# Commands that take two arguments: \frac{a}{b} as a/b, \href{url}{text} as its text.
_TWO_ARGUMENTS = frozenset("frac dfrac tfrac cfrac href".split())
# Without an argument these change how what follows looks, not what it says: {\em x} is x,
# $\bar x$ is x.
_SWITCHES = frozenset(
    "em bf it rm sc sf tt sl up md normalfont itshape bfseries scshape ttfamily sffamily "
    "rmfamily upshape mdseries small footnotesize scriptsize tiny normalsize large Large LARGE "
    "huge Huge hat bar tilde vec dot ddot widehat widetilde overline check breve acute grave "
    "mathring overrightarrow centering item".split()
)
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
    "colon": ":", "implies": "⟹", "iff": "⟺", "neg": "¬", "land": "∧", "lor": "∨",
    "cdotp": "·", "prime": "′", "-": "", "/": "", "@": "",
    # Letters arXiv author lists carry as LaTeX: \L{}ukasz, Bj\o{}rn, Stra\ss{}e
    "ss": "ß", "o": "ø", "O": "Ø", "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "aa": "å",
    "AA": "Å", "l": "ł", "L": "Ł", "i": "ı", "j": "ȷ",
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
_NAME = re.compile(r"([A-Za-z]+)\*?")
_MATH = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$((?:\\.|[^$\\])+?)\$", re.DOTALL)
_SCRIPT = re.compile(r"([\^_])\s*(?:" + _GROUP + r"|(\\[A-Za-z]+|[^\s{}\\]))")
# A reference with the space before it: "as shown \cite{x}." is "as shown."
_REFERENCE = re.compile(r"\s*\\(?:" + "|".join(sorted(_DROP_ARGUMENT)) + r")\*?\s*\{[^{}]*\}")


def latex_to_text(text: str) -> str:
    if not any(c in text for c in "\\$~{}`'-"):
        return text
    text = _REFERENCE.sub("", text)
    # Math and the prose around it apart: math's result is text already (`$\{1\}$` is {1}),
    # and reading it again as LaTeX would drop its braces.
    parts, pos = [], 0
    for match in _MATH.finditer(text):
        parts += [_prose(text[pos : match.start()]), _math(match.group(1) or match.group(2))]
        pos = match.end()
    parts.append(_prose(text[pos:]))
    return " ".join("".join(parts).split())


def _math(body: str) -> str:
    body = _SCRIPT.sub(_script, body)
    return _commands(body.replace("~", " "))


def _operand(group: str) -> str:
    text = _commands(group).strip()
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
    """Commands replaced by their text in one left-to-right pass: a replacement is never read
    again, so `\\to\\mathbb{R}` cannot glue into an unknown command `\\toR`, and arguments nest
    to any depth (`\\emph{\\textit{a {b {c}}}}`). An unbalanced brace is dropped."""
    text = _ACCENT.sub(_accent, text)
    out: list[str] = []
    pos, end = 0, len(text)
    while pos < end:
        char = text[pos]
        if char in "{}":  # a group's own braces (`{\em x}`), or an unbalanced one
            pos += 1
            continue
        if char != "\\" or pos + 1 == end:
            out.append(char)
            pos += 1
            continue
        name_match = _NAME.match(text, pos + 1)
        if name_match is None:  # \% \{ \, \\ and the like
            symbol = text[pos + 1]
            out.append(_SYMBOLS.get(symbol, symbol))
            pos += 2
            continue
        name, pos = name_match.group(1), name_match.end()
        argument, after = _argument(text, pos)
        if argument is None:
            out.append(_bare(name))
            continue
        pos = after
        if name in _TWO_ARGUMENTS:
            second, after_second = _argument(text, pos)
            if second is not None:
                pos = after_second
                out.append(
                    _commands(second)
                    if name == "href"
                    else f"{_operand(argument)}/{_operand(second)}"
                )
                continue
        out.append(_with_argument(name, argument))
    return "".join(out)


def _argument(text: str, pos: int) -> tuple[str | None, int]:
    """The balanced `{...}` group at `pos` (after blanks) and the position after it; (None,
    pos) when there is none or it never closes."""
    start = pos
    while start < len(text) and text[start] in " \t\n":
        start += 1
    if start >= len(text) or text[start] != "{":
        return None, pos
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ and \} do not count
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None, pos


def _with_argument(name: str, argument: str) -> str:
    if name in _DROP_ARGUMENT or name in _DROP_WITH_ARGUMENT:
        return ""
    inner = _commands(argument)
    if name == "sqrt":
        return f"√({inner.strip()})"
    if name in _SYMBOLS and name not in _KEEP_ARGUMENT:
        return _SYMBOLS[name] + inner  # \L{}ukasz; \hat{x}-like commands: symbol, argument
    return inner  # fonts, boxes, math accents, an unknown macro: its text is the best guess


def _bare(name: str) -> str:
    """A command without a braced argument: its symbol; nothing for a font switch, a math
    accent or a fonts command that lost its brace (`{\\em x}`, `\\bar x`, `\\textbf x`); else
    its name (a paper's own macro, `\\modelname`, reads as a word)."""
    if name in _SYMBOLS:
        return _SYMBOLS[name]
    if name in _KEEP_ARGUMENT or name in _SWITCHES or name in _DROP_WITH_ARGUMENT:
        return ""
    if name in _DROP_ARGUMENT:
        return ""
    return name


def _accent(match: re.Match[str]) -> str:
    return unicodedata.normalize("NFC", match.group(2) + _ACCENTS[match.group(1)])
