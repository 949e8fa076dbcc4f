"""Issue 35's faults for `port` and for files a user protected: nothing overwritten that
the user did not ask to replace, nothing written that does not compile, and one sentence
(exit 2) for input that is not a script or a notebook. In process: `port`'s command is
`tpu_utility.port.main`."""
import json
import os
import stat

import pytest
import torch

import tpu_utility as tu
from tpu_utility.port import main

SCRIPT = "import torch\n\n\ndef ones():\n    return torch.ones(2).cuda()\n"


def test_port_does_not_overwrite_an_output_that_differs_without_force(tmp_path, capsys):
    src = tmp_path / "train.py"
    src.write_text(SCRIPT)
    out = tmp_path / "train_tpu.py"
    out.write_text("# my hand edits\n")
    assert main([str(src)]) == 2
    assert "exists and differs from what port writes now" in capsys.readouterr().out
    assert out.read_text() == "# my hand edits\n"
    assert main([str(src), "--force"]) == 0  # asked for: replaced
    assert "torch.ones(2).to(tu.get_device())" in out.read_text()
    assert main([str(src)]) == 0  # the same text again: nothing to protect


def test_port_never_replaces_a_read_only_output(tmp_path, capsys):
    src = tmp_path / "train.py"
    src.write_text(SCRIPT)
    out = tmp_path / "train_tpu.py"
    out.write_text("# protected\n")
    out.chmod(0o444)
    assert main([str(src), "--force"]) == 2
    said = capsys.readouterr().out
    assert "cannot write" in said and "read-only (mode 444)" in said and "Traceback" not in said
    assert out.read_text() == "# protected\n" and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_port_output_compiles_where_a_form_feed_splits_lines(tmp_path):
    # str.splitlines breaks at \x0c, Python's parser does not: the spans landed wrong
    src = tmp_path / "ff.py"
    src.write_text("import torch\n\x0c\ndef f(model):\n    model.cuda()\n    x = 1 \x0c + 2\n"
                   "    torch.cuda.synchronize()\n")
    assert main([str(src)]) == 0
    text = (tmp_path / "ff_tpu.py").read_text()
    compile(text, "ff_tpu.py", "exec")
    assert "    model.to(tu.get_device())\n    x = 1 \x0c + 2\n    tu.sync()\n" in text


def test_port_reads_a_script_with_a_byte_order_mark(tmp_path):
    src = tmp_path / "bom.py"
    src.write_bytes(b"\xef\xbb\xbf" + SCRIPT.encode())
    assert main([str(src)]) == 0
    compile((tmp_path / "bom_tpu.py").read_text(), "bom_tpu.py", "exec")


def test_port_reads_and_writes_a_script_in_the_encoding_its_coding_line_declares(tmp_path, capsys):
    """PEP 263 (issue 47): a latin-1 script, and the latin-1 module it imports, which
    Python runs, are ported; each output keeps the coding line, the encoding and the
    characters, and runs."""
    coding = "# -*- coding: latin-1 -*-\n"
    (tmp_path / "helpers.py").write_bytes((coding + "import torch\n\n\ndef put(x):\n"
                                           "    return x.cuda()  # \u00e9t\u00e9\n").encode("latin-1"))
    src = tmp_path / "train.py"
    src.write_bytes((coding + "import torch\nfrom helpers import put\n\nNAME = 'caf\u00e9'\n\n\n"
                     "def ones():\n    return torch.ones(2).cuda()  # na\u00efve\n").encode("latin-1"))
    assert main([str(src)]) == 0, capsys.readouterr().out
    out, module = tmp_path / "train_tpu.py", tmp_path / "helpers_tpu.py"
    data, module_data = out.read_bytes(), module.read_bytes()
    assert data.startswith(coding.encode()) and module_data.startswith(coding.encode())
    text, module_text = data.decode("latin-1"), module_data.decode("latin-1")
    assert "NAME = 'caf\u00e9'" in text and "# na\u00efve" in text and "# \u00e9t\u00e9" in module_text
    assert "torch.ones(2).to(tu.get_device())" in text and "from helpers_tpu import put" in text
    compile(data, str(out), "exec")  # bytes: as Python reads the file, by its coding line
    compile(module_data, str(module), "exec")
    import subprocess, sys
    ran = subprocess.run([sys.executable, "-c", "import runpy; print(runpy.run_path('train_tpu.py')['NAME'])"],
                         cwd=tmp_path, capture_output=True, text=True, encoding="utf-8",
                         env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert ran.returncode == 0 and ran.stdout.strip() == "caf\u00e9", ran.stderr
    assert main([str(src)]) == 0  # the same bytes again: nothing to protect
    (tmp_path / "odd.py").write_bytes(b"# -*- coding: klingon -*-\nimport torch\n")
    assert main([str(tmp_path / "odd.py")]) == 2
    said = capsys.readouterr().out
    assert "cannot be read as Python reads it (unknown encoding" in said and "Traceback" not in said


@pytest.mark.parametrize("name, data, said", [
    ("binary.py", b"\x80\x81\x00torch", "is not UTF-8 text"),
    ("broken.ipynb", b'{"cells": [', "is not a notebook: its JSON breaks at line 1"),
])
def test_port_says_in_one_sentence_what_it_cannot_read(tmp_path, capsys, name, data, said):
    (tmp_path / name).write_bytes(data)
    assert main([str(tmp_path / name)]) == 2
    out = capsys.readouterr().out
    assert said in out and "nothing written" in out and "Traceback" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_port_says_it_cannot_write_where_the_output_is_a_folder(tmp_path, capsys):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "train_tpu.py").mkdir()
    assert main([str(tmp_path / "train.py")]) == 2
    assert "port: cannot write" in capsys.readouterr().out


def test_save_refuses_a_read_only_file_and_keeps_a_replaced_files_mode(tmp_path):
    best = tmp_path / "best.pt"
    torch.save({"w": torch.zeros(1)}, best)
    before = best.read_bytes()
    best.chmod(0o444)
    with pytest.raises(OSError, match=r"read-only \(mode 444\).*chmod u\+w"):
        tu.save({"w": torch.ones(1)}, str(best))
    assert best.read_bytes() == before
    private = tmp_path / "private.pt"
    torch.save({}, private)
    private.chmod(0o600)
    tu.save({"w": torch.ones(1)}, str(private))
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert torch.load(private, weights_only=True)["w"].item() == 1.0
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
