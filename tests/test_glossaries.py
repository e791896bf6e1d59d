"""The glossaries of the CUDA chapters (05a, 05b, 07): every term of a notebook's "Glossary, checked" table
is defined in bold (`**term**`, or `**`term`**`, a plural `s` allowed) before it is first used anywhere in
the notebook's text or code after the opening cells (the header and the two setup cells only announce what
is coming). The table is the one list of terms: a row's first column names them, separated by commas;
a part in parentheses after a space (`atomic (`atomicAdd`)`) only says how it is written, unchecked.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = ["05a_cuda_basics", "05b_paged_kernel", "07_fast_kernel"]
SKIP_CELLS = 3  # the header and the two setup cells
# terms a table names that the text explains without a bold definition (05b defines a template in bold and
# shows `#pragma unroll` in code beside it)
NOT_BOLD = {"05b_paged_kernel": {"#pragma unroll"}}


def cells(chapter: str) -> list[str]:
    notebook = json.loads((NOTEBOOKS / f"{chapter}.ipynb").read_text())
    return ["".join(cell["source"]) for cell in notebook["cells"]]


def glossary_terms(sources: list[str]) -> list[str]:
    """The terms of the table in the markdown cell whose heading says "Glossary, checked", in order."""
    (cell,) = [s for s in sources if re.search(r"^#+ .*Glossary, checked", s, re.M)]
    rows = [line for line in cell.splitlines() if line.startswith("|")][2:]  # past the header and |---|
    assert rows, "the glossary cell has no table"
    terms = []
    for row in rows:
        first = row.split("|")[1]
        first = re.sub(r"\s\([^)]*\)", "", first)  # atomic (`atomicAdd`) -> atomic; keeps __syncthreads()
        terms += [t.strip().strip("`").strip() for t in first.split(",") if t.strip()]
    return terms


def first_definition_and_use(text: str, term: str) -> tuple[int, int]:
    """Character offsets of the first `**term**` and of the first use of term (a whole word); a lowercase
    term matches in any case, one with capitals (SM, CuPy, L2) exactly."""
    flags = re.I if term.islower() else 0
    bold = re.search(rf"\*\*`?{re.escape(term)}`?s?\*\*", text, flags)
    use = re.search(rf"(?<!\w){re.escape(term)}(?!\w)", text, flags)
    assert bold and use, f"{term!r} is never defined in bold"
    return bold.start(), use.start()


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_glossary_term_is_defined_in_bold_before_its_first_use(chapter):
    sources = cells(chapter)
    terms = [t for t in glossary_terms(sources) if t not in NOT_BOLD.get(chapter, set())]
    assert len(terms) == len(set(terms)), f"a term is listed twice: {terms}"
    text = "\n\n".join(sources[SKIP_CELLS:])
    found = {term: first_definition_and_use(text, term) for term in terms}
    late = {t: d for t, d in found.items() if d[0] > d[1]}
    assert not late, f"{chapter}: used before defined (offset of definition, offset of first use): {late}"


def test_the_glossary_check_can_fail():
    table = (
        "## 8. Glossary, checked\n\n| term | meaning |\n|---|---|\n| `__syncthreads()`, lane (`x`) | . |\n"
    )
    assert glossary_terms(["# x", table]) == ["__syncthreads()", "lane"]
    text = "a warp runs ... a **warp** is 32 threads"
    bold, use = first_definition_and_use(text, "warp")
    assert use < bold  # used before its definition: the test above would report it
    with pytest.raises(AssertionError, match="'lane' is never defined in bold"):
        first_definition_and_use(text + " one lane", "lane")
    bold, use = first_definition_and_use("the **SMs** of the GPU; one SM runs blocks, sm_90", "SM")
    assert bold == 4 and use == 28  # a plural defines; capitals match exactly (not sm_90)
