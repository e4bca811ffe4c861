"""arXiv's category names, checked before a run: a malformed one ("CS.CL", "cs.CL;rm", or
"cs.CL OR all:x", which would go into the API query as query syntax) is refused, and one that is
well formed but not in arXiv's taxonomy ("cs.XX") is named in a warning, since it matches no
paper and a typo would otherwise publish an empty digest every night without a word.

The taxonomy is arXiv's (https://arxiv.org/category_taxonomy); arXiv adds a category rarely,
which is why an unknown one is a warning and not an error."""

from __future__ import annotations

import re

# archive, or archive.subject: lower-case archive (with one hyphen: astro-ph, q-bio), subject
# upper-case (cs.CL) or lower-case with hyphens (cond-mat.str-el, physics.atom-ph).
_CATEGORY = re.compile(r"^[a-z]+(?:-[a-z]+)?(?:\.(?:[A-Z]{2}|[a-z]+(?:-[a-z]+)*))?$")

_SUBJECTS = {
    "cs": "AI AR CC CE CG CL CR CV CY DB DC DL DM DS ET FL GL GR GT HC IR IT LG LO MA MM MS NA "
    "NE NI OH OS PF PL RO SC SD SE SI SY",
    "econ": "EM GN TH",
    "eess": "AS IV SP SY",
    "math": "AC AG AP AT CA CO CT CV DG DS FA GM GN GR GT HO IT KT LO MG MP NA NT OA OC PR QA RA "
    "RT SG SP ST",
    "astro-ph": "CO EP GA HE IM SR",
    "cond-mat": "dis-nn mes-hall mtrl-sci other quant-gas soft stat-mech str-el supr-con",
    "physics": "acc-ph ao-ph app-ph atm-clus atom-ph bio-ph chem-ph class-ph comp-ph data-an "
    "ed-ph flu-dyn gen-ph geo-ph hist-ph ins-det med-ph optics plasm-ph pop-ph soc-ph space-ph",
    "nlin": "AO CD CG PS SI",
    "q-bio": "BM CB GN MN NC OT PE QM SC TO",
    "q-fin": "CP EC GN MF PM PR RM ST TR",
    "stat": "AP CO ME ML OT TH",
}
# Archives without subject classes. An archive that has them ("cs") is not a category itself.
_WHOLE = "gr-qc hep-ex hep-lat hep-ph hep-th math-ph nucl-ex nucl-th quant-ph"
KNOWN = frozenset(
    {f"{archive}.{subject}" for archive, names in _SUBJECTS.items() for subject in names.split()}
    | set(_WHOLE.split())
)


def malformed(categories: list[str]) -> list[str]:
    """Those of `categories` that are not arXiv category names in form."""
    return [c for c in categories if not _CATEGORY.match(c)]


def unknown(categories: list[str]) -> list[str]:
    """Well-formed names that arXiv's taxonomy does not have (as of 2026)."""
    return [c for c in categories if _CATEGORY.match(c) and c not in KNOWN]
