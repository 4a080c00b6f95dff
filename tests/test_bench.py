"""`gguf-prefill bench`: argument handling, rows, JSON and breakdown formatting (CPU), and the
GPU timings' sanity where a GPU is present."""
from __future__ import annotations

import json
import os
import statistics

import pytest

from engine.tools import bench
from engine.cli import main as cli_main
from engine.errors import UsageError


def test_parse_int_list():
    assert bench.parse_int_list("512,3314", "-p") == [512, 3314]
    assert bench.parse_int_list(" 1, 2 ,", "-p") == [1, 2]
    with pytest.raises(UsageError):
        bench.parse_int_list("x", "-p")
    with pytest.raises(UsageError):
        bench.parse_int_list("", "-p")
    with pytest.raises(UsageError):
        bench.parse_int_list("-5", "-d")


def test_model_info(tiny_model_path):
    info = bench.model_info(tiny_model_path)
    assert info.label.startswith("llama ") and info.label.endswith("Q4_K_M")
    assert info.n_params > 1_000_000 and info.size_bytes > 1_000_000
    assert info.size_str.endswith("MiB") and info.params_str.endswith("M")


def test_cpu_rows_table(tiny_model_path, capsys):
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "-p", "8,16", "-r", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].split("|")[1].strip() == "model"
    assert any("pp8" in ln for ln in lines) and any("pp16" in ln for ln in lines)
    assert "±" in out


def test_cpu_json_and_depth(tiny_model_path, capsys):
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "-p", "8", "-d", "0,4",
                   "-r", "3", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in d["rows"]] == ["pp8", "pp8 @ d4"]
    for r in d["rows"]:
        assert len(r["samples_ts"]) == 3 and r["avg_ts"] > 0 and r["median_ts"] > 0
        assert r["stddev_ts"] >= 0 and r["n_prompt"] == 8
    assert d["model_n_params"] > 0 and d["backend"].startswith("CPU")


@pytest.mark.parametrize("argv", [
    ["-p", "8", "--breakdown"],          # breakdown needs the GPU backend
    ["-p", "8", "-r", "0"],
    ["-p", "0", "-n", "0"],              # nothing to run
    ["-p", "8,y"],
    ["-p", "8", "-n", "4"],              # tg rows need the GPU decode path
])
def test_usage_errors_exit_2(tiny_model_path, argv, capsys):
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("gguf-prefill bench: error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["-p", "8", "-n", "4"], ["-p", "8", "--breakdown"]])
def test_gpu_only_options_rejected_before_loading(tiny_model_path, argv, monkeypatch, capsys):
    """Issue 15: a CPU run asking for tg rows or a breakdown fails before the model loads."""
    import engine.loader

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine.loader, "load_model", no_load)
    assert cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", *argv]) == 2
    assert "gguf-prefill bench: error:" in capsys.readouterr().err


def test_cpu_reports_real_load_time(tiny_model_path, capsys):
    """Issue 15: the CPU backend has no load_seconds of its own; bench times the load itself."""
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "-p", "8", "-r", "1", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["load_seconds"] > 0
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "-p", "8", "-r", "1"])
    out = capsys.readouterr().out
    assert "; load " in out and "; load 0.00 s" not in out


def test_breakdown_format_and_categories():
    b = bench.Breakdown("pp512", total_ms=10.0, plain_ms=9.5,
                        ops={"gemm_q4_k": 6.0, "gemm_q6_k": 1.5, "gemm_output_q6_k": 0.1, "attention": 1.0,
                             "rmsnorm_q8": 0.5, "swiglu_q8": 0.3, "rope_kv": 0.2, "embed": 0.05},
                        launches={"gemm_q4_k": 112})
    cats = b.categories()
    assert cats["q4_K GEMMs"] == 6.0 and cats["q6_K GEMMs"] == pytest.approx(1.6)
    assert cats["norms/rope/rest"] == pytest.approx(0.25)
    assert cats["unattributed (gaps between launches)"] == pytest.approx(10.0 - 9.65)
    assert sum(cats.values()) == pytest.approx(10.0)
    text = bench.format_breakdown(b)
    assert "gemm_q4_k" in text and "112" in text and "attention" in text and "%" in text


def test_row_statistics():
    r = bench.Row("pp4", 4, 0, 0, [100.0, 110.0, 90.0], [40.0, 36.4, 44.4], "x")
    assert r.mean == pytest.approx(100.0) and r.median == 100.0 and r.sd == pytest.approx(10.0)
    assert bench.Row("pp4", 4, 0, 0, [5.0], [1.0], "x").sd == 0.0


@pytest.mark.gpu
def test_gpu_bench_rows_and_breakdown(tiny_model_path, capsys):
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "gpu", "-p", "64", "-r", "3",
                   "--breakdown", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    (row,) = d["rows"]
    assert row["backend"].startswith("CUDA") and all(t > 0 for t in row["samples_ts"])
    (b,) = d["breakdown"]
    assert b["launches"]["attention"] == 4 and b["launches"]["embed"] == 1
    assert 0 < sum(b["ops"].values()) <= b["total_ms"] * 1.01


def test_batched_rows_cpu(tiny_model_path, capsys):
    """--batched: llama-batched-bench's rows through the scheduler, with and without overlap."""
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "--batched", "1,3", "--npp", "9",
                   "--ntg", "5", "-r", "2", "--overlap", "both", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["batched"]
    assert [(r["npl"], r["overlap"]) for r in rows] == [(1, True), (1, False), (3, True), (3, False)]
    for r in rows:
        assert len(r["pp_s"]) == len(r["tg_s"]) == 2 and min(r["pp_s"] + r["tg_s"]) > 0
        assert r["s_tg"] > 0 and r["s_pp"] > 0 and r["s_total"] > 0
        assert r["step_wall_ms"] > 0 and r["step_device_ms"] is None          # no device clock
        total = statistics.median(a + b for a, b in zip(r["pp_s"], r["tg_s"]))
        assert r["s_total"] == pytest.approx(r["npl"] * 5 / total)
        assert r["s_tg"] == pytest.approx(r["npl"] * 4 / statistics.median(r["tg_s"]))
    rc = cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", "--batched", "2", "--npp", "9",
                   "--ntg", "5", "-r", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pp9+tg5 x2" in out and "S_TG t/s" in out


@pytest.mark.parametrize("argv", [
    ["--batched", "2", "--breakdown"],       # the step breakdown needs the GPU backend
    ["--batched", "0"],
    ["--batched", "2", "--npp", "0"],
    ["--batched", "2", "--ntg", "0"],
    ["--batched", "2", "--max-batch-tokens", "0"],
])
def test_batched_bad_arguments(tiny_model_path, capsys, argv):
    assert cli_main(["bench", "--model", tiny_model_path, "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gguf-prefill bench: error:") and len(err.strip().splitlines()) == 1


def test_ab_bench_summary():
    """dev/ab_bench: medians over every round's samples, ratios to the first set, and each set's
    quotient of its last two pp rows (issue 14's pp8192 / pp3314, also behind pp32 and pp128)."""
    from dev.ab_bench import format_rows, summarize

    samples = {"": {"pp10": [100.0, 102.0, 98.0], "pp20": [90.0, 91.0, 89.0]},
               "X=1": {"pp10": [110.0, 120.0, 100.0], "pp20": [99.0, 99.0, 99.0]}}
    rows = summarize(samples, ["", "X=1"], ["pp10", "pp20"], ["pp10", "pp20"])
    by = {(r["set"], r["test"]): r for r in rows}
    assert by[("", "pp10")]["median"] == 100.0 and by[("", "pp10")]["ratio"] == 1.0
    assert by[("X=1", "pp10")]["ratio"] == pytest.approx(1.10)
    assert by[("X=1", "pp20")]["ratio"] == pytest.approx(1.10)
    assert by[("", "pp20/pp10")]["median"] == pytest.approx(0.90) and by[("", "pp20/pp10")]["ratio"] is None
    assert by[("X=1", "pp20/pp10")]["median"] == pytest.approx(0.90)
    text = format_rows(rows)
    assert "| (none) | pp10 | 100.0 | 1.000 |" in text and "| X=1 | pp20/pp10 | 0.900 |  |" in text
    samples[""]["pp5"] = [300.0]
    rows = summarize(samples, [""], ["pp5", "pp10", "pp20"], ["pp5", "pp10", "pp20"])
    assert [r["test"] for r in rows if r["ratio"] is None] == ["pp20/pp10"]


def test_ab_bench_ubatch_entry(monkeypatch):
    """dev/ab_bench: a set's UBATCH=N / ATTN_X16=1 entries set the model's ubatch / attn_x16 for
    that set's rows only and are not passed on as kernel defines; the model's own values and the
    variable come back after."""
    from dev.ab_bench import ENV, host_entries, run_sets

    assert host_entries("") == ("", {})
    assert host_entries("A=1,UBATCH=8192 B=2 ATTN_X16=1") == ("A=1,B=2", {"ubatch": 8192, "attn_x16": True})
    with pytest.raises(ValueError, match="UBATCH"):
        host_entries("UBATCH=0")
    monkeypatch.setenv(ENV, "KEEP=1")

    class Row:
        def __init__(self, test):
            self.test, self.samples_ts, self.median = test, [1.0], 1.0

    class Model:
        ubatch = 4096
        attn_x16 = False

    seen = []

    def bench_pp(model, p, depth, reps):
        seen.append((os.environ[ENV], model.ubatch, model.attn_x16))
        return Row(f"pp{p}")

    model = Model()
    samples, tests = run_sets(model, ["", "UBATCH=8192,A=1", "ATTN_X16=1"], [10], [], 1, 2, bench_pp, None)
    assert seen == [("", 4096, False), ("A=1", 8192, False), ("", 4096, True)] * 2
    assert tests == ["pp10"] and samples["UBATCH=8192,A=1"]["pp10"] == [1.0, 1.0]
    assert model.ubatch == 4096 and not model.attn_x16 and os.environ[ENV] == "KEEP=1"


def test_ab_bench_pp_entry():
    """dev/ab_bench: a set's PP=a:b entry times only those pp rows and no tg rows; the summary
    gives its rows ratios to the baseline's and a quotient only where it has both last pp rows."""
    from dev.ab_bench import host_entries, run_sets, summarize

    assert host_entries("UBATCH=8192,PP=8192") == ("", {"ubatch": 8192, "pp": [8192]})
    assert host_entries("PP=32:8192")[1] == {"pp": [32, 8192]}
    for bad in ("PP=", "PP=0", "PP=1:x"):
        with pytest.raises(ValueError, match="PP="):
            host_entries(bad)
    assert host_entries("MMVQ_UNROLL=4,TG=1") == ("MMVQ_UNROLL=4", {"pp": []})
    with pytest.raises(ValueError, match="TG="):
        host_entries("TG=0")

    class Row:
        def __init__(self, test, value):
            self.test, self.samples_ts, self.median = test, [value], value

    class Model:
        ubatch = 4096

    def bench_pp(model, p, depth, reps):
        return Row(f"pp{p}", float(p + model.ubatch))

    def bench_tg(model, n, depth, reps):
        return Row(f"tg{n}", 1.0)

    sets = ["", "UBATCH=8192,PP=8192", "TG=1"]
    samples, tests = run_sets(Model(), sets, [3314, 8192], [128], 1, 1, bench_pp, bench_tg)
    assert tests == ["pp3314", "pp8192", "tg128"]
    assert samples["UBATCH=8192,PP=8192"] == {"pp8192": [16384.0]}
    assert samples["TG=1"] == {"tg128": [1.0]}
    rows = summarize(samples, sets, tests, ["pp3314", "pp8192"])
    mine = [r for r in rows if r["set"] == "UBATCH=8192,PP=8192"]
    assert [(r["test"], r["ratio"]) for r in mine] == [("pp8192", 16384.0 / 12288.0)]
    assert [r["test"] for r in rows if r["set"] == ""] == ["pp3314", "pp8192", "tg128", "pp8192/pp3314"]
    assert [r["test"] for r in rows if r["set"] == "TG=1"] == ["tg128"]


def test_ab_bench_keeps_only_tested_forms(tmp_path, capsys):
    """dev/ab_bench --keep-tested: a define set that only failed GPU test groups ran is not timed
    (a hung form would take every set's rows with it); one a passed group covers, one no group
    covers, and the baseline stay."""
    from dev.ab_bench import main

    groups = tmp_path / "test_groups.txt"
    groups.write_text("fail A=1,B=1,P=5\npass A=1\n")
    assert main(["--keep-tested", str(groups), "--sets", ";A=1;A=1,B=1;C=4"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == ";A=1;C=4"
    assert "dropped (its GPU tests failed): A=1,B=1" in out.err
    groups.write_text("fail A=1\n")
    assert main(["--keep-tested", str(groups), "--sets", "A=1;A=1"]) == 0
    assert capsys.readouterr().out.strip() == "A=1"
    # host entries (UBATCH, PP) are not defines: a failed A=1 drops "A=1,PP=32:128" too
    assert main(["--keep-tested", str(groups), "--sets", ";A=1,PP=32:128;UBATCH=8192,PP=8192"]) == 0
    assert capsys.readouterr().out.strip() == ";UBATCH=8192,PP=8192"


def test_sass_control_listing():
    """dev.sass_dump --ctrl decodes sm_90's control word: stall, the scoreboards an instruction
    sets (write, read; 7 = none) and the ones it waits on."""
    from dev.sass_dump import control_listing

    hi = (1 << 41) | (5 << 46) | (0 << 49) | (0b100001 << 52)      # stall 1, wr 5, rd 0, waits on 0 and 5
    none = (2 << 41) | (7 << 46) | (7 << 49)
    text = ("        /*0e50*/  @!P0 LDG.E.CONSTANT R101, desc[UR24][R44.64] ;  /* 0x0000000000000000 */\n"
            f"                                                               /* 0x{hi:016x} */\n"
            "        /*0e60*/  IADD3 R1, R2, R3, RZ ;  /* 0x0000000000000000 */\n"
            f"                                                               /* 0x{none:016x} */\n")
    lines = control_listing(text).splitlines()
    assert lines[0].split() == ["0e50", "stall", "1", "wr", "5", "rd", "0", "wait", "05", "@!P0", "LDG.E.CONSTANT",
                                "R101,", "desc[UR24][R44.64]"]
    assert lines[1].split()[:8] == ["0e60", "stall", "2", "wr", "-", "rd", "-", "wait"] and lines[1].split()[8] == "-"


def test_ncu_src_summary():
    """dev/ncu_src_summary: finds the source and samples columns by name past ncu's own lines,
    ranks instructions by stall samples with their largest reasons, and sums them per opcode."""
    from dev.ncu_src_summary import opcode, summarize

    text = "\n".join([
        "==PROF== Disconnected",
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_long_sb","stall_wait"',
        '"0x10","@!P0 BRA `(.L_x_9)",10,9,0,10',
        '"0x20","HFMA2 R1, R2, R3, R4",30,20,0,30',
        '"0x30","LDG.E.128.CONSTANT R8, desc[UR4][R2.64]","1,060",60,60,0',
        '"0x40","HFMA2.MMA R5, R6, R7, R8",0,0,0,0',
    ])
    out = summarize(text, top=2).splitlines()
    assert out[0] == "4 instructions, 1,100 stall samples"
    assert "96.4%" in out[2] and "LDG.E.128" in out[2] and "stall_long_sb 6%" in out[2]
    assert "2.7%" in out[3] and "HFMA2 R1" in out[3] and "stall_wait 100%" in out[3]
    assert len(out) == 6
    assert out[4].startswith("per opcode: LDG 96.4%  HFMA2 2.7%  BRA 0.9%")
    assert out[5].startswith("per reason: stall_long_sb 5.5%  stall_wait 3.6%")
    assert opcode("@!P0 BRA `(.L_x_9)") == "BRA" and opcode("HGMMA.64x32x16.F32 R24") == "HGMMA"
    with pytest.raises(ValueError, match="Source"):
        summarize("no,csv,here")
