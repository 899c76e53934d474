"""Words that match the facts (issue 31): explain's near names for a misspelled patch, and the
kill switch named as the user set it."""
import json
import os
import subprocess
import sys

from npu_fsdp_patches.cli.render import unknown_patch_message


def _cli(*args, **env):
    child = {k: v for k, v in os.environ.items() if not k.startswith("NPU_FSDP_PATCHES")}
    child.update(env)
    return subprocess.run([sys.executable, "-m", "npu_fsdp_patches", *args], capture_output=True, text=True,
                          timeout=300, env=child)


def test_explain_of_an_unknown_name_suggests_the_near_ones():
    known = ["te_fused_adam_dtensor", "te_fused_adam_empty_scale", "hp_fp32_main_params"]
    assert unknown_patch_message("te_fused_adam_dtensr", known) == (
        "unknown patch 'te_fused_adam_dtensr'. Did you mean te_fused_adam_dtensor or te_fused_adam_empty_scale? Known: "
        "hp_fp32_main_params, te_fused_adam_dtensor, te_fused_adam_empty_scale")
    assert unknown_patch_message("zzz", known) == ("unknown patch 'zzz'; known: hp_fp32_main_params, "
                                                   "te_fused_adam_dtensor, te_fused_adam_empty_scale")
    # a prefix or part of a name, in any case, is near too; difflib alone finds nothing for these
    assert unknown_patch_message("hp_fp32", known).startswith(
        "unknown patch 'hp_fp32'. Did you mean hp_fp32_main_params? Known: ")
    assert unknown_patch_message("Empty_Scale", known).startswith(
        "unknown patch 'Empty_Scale'. Did you mean te_fused_adam_empty_scale? Known: ")
    assert unknown_patch_message("te", known).startswith("unknown patch 'te'; known: ")   # too short to guess
    proc = _cli("explain", "te_fused_adam")
    assert proc.returncode == 2
    assert ("Did you mean te_fused_adam_dtensor or te_fused_adam_empty_group_step or te_fused_adam_empty_scale"
            in proc.stderr), proc.stderr


def test_doctor_names_the_kill_switch_as_it_was_set():
    report = json.loads(_cli("doctor", "--json", NPU_FSDP_PATCHES="off").stdout)
    reasons = {p["reason"] for p in report["patches"]}
    assert reasons == {"NPU_FSDP_PATCHES=off (kill switch)"}, reasons


def test_no_command_is_doctor_and_help_says_so():
    bare, doctor = _cli(), _cli("doctor")
    assert bare.returncode == doctor.returncode == 0 and bare.stdout == doctor.stdout, bare.stderr
    assert "with no command, doctor." in _cli("--help").stdout
