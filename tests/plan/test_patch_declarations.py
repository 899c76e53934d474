"""A patch lives in its module: the built-in list, each patch's self-test check and its docs paragraph
are read from what ``patches/*.py`` declare (npu_fsdp_patches/plan/declarations.py), without importing them."""
import importlib
import inspect
import re

import pytest

from npu_fsdp_patches.plan import declarations, loader
from npu_fsdp_patches.plan.matrix import load_matrix
from tests.support import REPO_ROOT

SHIPPED = ["hp_fp32_main_params", "hp_skip_dispatch_adamw", "te_fused_adam_dtensor", "te_fused_adam_empty_group_step",
           "te_fused_adam_empty_scale",
           "te_initialize_state_compat", "te_multi_tensor_apply_empty_tail"]
BUILTINS = loader.builtin_declarations()


def _class(value: str):
    module, _, name = value.partition(":")
    return getattr(importlib.import_module(module), name)


def test_the_builtins_are_the_patch_classes_of_patches_and_the_matrix_names_them_all():
    assert sorted(d.name for d in BUILTINS) == SHIPPED == sorted(load_matrix().patches)
    assert loader.builtin_table() == {d.name: d.value for d in BUILTINS}
    assert all(d.problem is None for d in BUILTINS), [d.problem for d in BUILTINS]


@pytest.mark.parametrize("declared", BUILTINS, ids=lambda d: d.name)
def test_what_the_source_declares_is_what_the_class_holds(declared):
    cls = _class(declared.value)
    assert (cls.name, cls.self_test, inspect.cleandoc(cls.__doc__)) == (
        declared.name, declared.self_test, declared.doc)


def test_a_declaration_that_is_not_a_literal_is_reported_not_guessed():
    source = ('from npu_fsdp_patches.patch import Patch\nCHECK = {}\n'
              'class P(Patch):\n    """Doc."""\n    name = "p"\n    self_test = CHECK\n')
    (found,) = declarations.read_source(source, "pkg.mod")
    assert found.value == "pkg.mod:P" and found.self_test is None and found.doc == "Doc."
    assert found.problem == "P.self_test must be a literal (line 6)"
    bad = declarations.read_source(source.replace("= CHECK", '= {"name": "x"}'), "pkg.mod")[0]
    assert bad.problem.startswith("self_test must be None or {'name': str, 'order': int")


def _fix_paragraphs() -> dict:
    """patch name -> the text of its section's **Fix.** paragraph in docs/patches.md, one line."""
    text = (REPO_ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    out = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        name, _, body = section.partition("\n")
        for paragraph in body.split("\n\n"):
            if paragraph.strip().startswith("**Fix.** "):
                out[name.strip()] = " ".join(paragraph.split())[len("**Fix.** "):]
    return out


def test_each_patch_fix_paragraph_in_docs_is_its_declared_doc():
    fixes = _fix_paragraphs()
    assert {d.name: fixes.get(d.name) for d in BUILTINS} == {d.name: " ".join(d.doc.split()) for d in BUILTINS}


def _readme_patch_rows() -> list:
    """The first column of the README's patch table (the table whose header starts with ``| patch |``)."""
    lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| patch |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def _docs_patch_sections() -> list:
    """Every third-level heading of docs/patches.md: each is one patch's section."""
    text = (REPO_ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    return [heading.strip() for heading in re.findall(r"^### (.+)$", text, flags=re.M)]


def test_every_shipped_patch_has_one_readme_row_and_one_docs_section_and_nothing_else_does():
    builtins = sorted(d.name for d in BUILTINS)
    assert sorted(_readme_patch_rows()) == builtins
    assert sorted(_docs_patch_sections()) == builtins
