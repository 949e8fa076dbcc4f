"""plots.py without a device: tick values and labels, text boxes that never overlap, the
legend kept off the curves, and training.png's note on the logged curve. Expected values
are worked out by hand in the comments."""
import itertools
import math
import os

import pytest
from PIL import Image, ImageFont

from tpu_utility import plots
from tpu_utility.loop.state import EpochStats, History
from tpu_utility.plots import layout, log_ticks, nice_ticks, plot_history, plot_lines, tick_labels

FONTS = ["default"] + (["bitmap"] if hasattr(ImageFont, "load_default_imagefont") else [])


@pytest.fixture(params=FONTS)
def font(request, monkeypatch):
    """Both fonts users meet: Pillow >= 10.1's small TrueType default, and the bitmap
    font that is the default before it (and where FreeType is missing)."""
    if request.param == "bitmap":
        monkeypatch.setattr(plots, "_default_font", ImageFont.load_default_imagefont)
    return request.param


# --- tick values ---------------------------------------------------------------------

def test_nice_ticks_on_a_loss_range():
    # span 1.177 / 7 = 0.17: step 0.1 gives 0.6..1.7 (12 ticks), step 0.2 gives 0.6..1.6 (6)
    assert nice_ticks(0.593, 1.77, 7) == [0.6, 0.8, 1.0, 1.2, 1.4, 1.6]
    # at most 3: step 0.5 gives 1.0, 1.5 (0.5 is under 0.593)
    assert nice_ticks(0.593, 1.77, 3) == [1.0, 1.5]


def test_nice_ticks_whole_numbers_on_a_step_axis():
    # 0..144, at most 7: steps 10 (15 ticks) and 20 (8) are too fine, 50 gives 0, 50, 100
    assert nice_ticks(0, 144, 7, integer=True) == [0, 50, 100]
    assert nice_ticks(0, 144, 8, integer=True) == [0, 20, 40, 60, 80, 100, 120, 140]
    # a short axis never gets half steps
    assert nice_ticks(0, 3, 9, integer=True) == [0, 1, 2, 3]
    assert all(isinstance(t, int) for t in nice_ticks(0, 3, 9, integer=True))


def test_nice_ticks_on_a_tiny_range_and_negative_values():
    # span ~1e-3 / 7: step 1e-4 gives 10 ticks, 2e-4 gives 2e-4..1e-3 (0 is under 2.02e-6)
    assert nice_ticks(2.02e-06, 1e-3, 7) == [2e-4, 4e-4, 6e-4, 8e-4, 1e-3]
    # -3.7..2.2: steps 0.5 (12 ticks) too fine, 1 gives -3..2
    assert nice_ticks(-3.7, 2.2, 7) == [-3, -2, -1, 0, 1, 2]
    assert nice_ticks(5.0, 5.0) == [5.0]


def test_log_ticks_are_decades():
    assert log_ticks(1e-7, 8.3) == [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    assert log_ticks(1e-7, 10.0, 9) == [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    # 9 decades, at most 5 ticks: every second decade
    assert log_ticks(1e-7, 10.0, 5) == [1e-6, 1e-4, 1e-2, 1.0]
    # under two decades: 1, 2 and 5 times them
    assert log_ticks(0.003, 0.06) == [0.005, 0.01, 0.02, 0.05]


# --- tick labels ---------------------------------------------------------------------

@pytest.mark.parametrize("values, integer, expected", [
    ([0.5, 1.0, 1.5], False, ["0.5", "1", "1.5"]),
    ([0.6, 0.8, 1.0, 1.2], False, ["0.6", "0.8", "1", "1.2"]),
    ([0.25, 0.5, 0.75], False, ["0.25", "0.5", "0.75"]),  # 0.25 is not "0.2" or "0.3"
    ([0, 50, 100], True, ["0", "50", "100"]),
    ([-1.0, -0.5, -0.0, 0.5], False, ["-1", "-0.5", "0", "0.5"]),
    ([2e-4, 4e-4, 6e-4, 8e-4, 1e-3], False, ["2e-4", "4e-4", "6e-4", "8e-4", "1e-3"]),
    ([1.5e-6, 2e-6, 2.5e-6], False, ["1.5e-6", "2e-6", "2.5e-6"]),
    ([0.0, 2e5, 4e5], False, ["0", "2e5", "4e5"]),
    # "0.0015" and "1.5e-3" are as long: the plain decimal wins
    ([0.0, 0.0005, 0.001, 0.0015], False, ["0", "0.0005", "0.001", "0.0015"]),
    ([1e-7, 1e-6, 1e-1, 1.0, 10.0], False, ["1e-7", "1e-6", "1e-1", "1e0", "1e1"]),
])
def test_tick_labels_use_the_fewest_digits(values, integer, expected):
    assert tick_labels(values, integer=integer) == expected


# --- layouts -------------------------------------------------------------------------

def lr_find_inputs():
    """lr_find's plot: 100 lrs from 1e-7 to 10, a raw and a smoothed loss that fall, then
    diverge, and four marks, three of them within a factor of 2."""
    lrs = [1e-7 * 1e8 ** (i / 99) for i in range(100)]
    smooth = [2.3 - 0.9 / (1 + math.exp(-(math.log10(lr) + 2.5) * 2)) + max(0.0, math.log10(lr) + 0.5) ** 2
              for lr in lrs]
    raw = [v + 0.05 * math.sin(7 * i) for i, v in enumerate(smooth)]
    # both scaled to run from exactly 1.4 to 2.4, so the expected ticks are easy to work out
    smooth, raw = ([1.4 + (v - min(c)) / (max(c) - min(c)) for v in c] for c in (smooth, raw))
    marks = [(1.7e-1, "slide 1.7e-01"), (3e-2, "valley 3.0e-02"), (3.3e-2, "steep 3.3e-02"),
             (1.6e-2, "minimum 1.6e-02")]
    return {"loss": (lrs, raw), "smoothed loss": (lrs, smooth)}, marks


def training_inputs():
    """plot_history's loss panel: 3 epochs of 48 steps, logged at 1, 50 and 100."""
    return {"train (epoch)": ([48, 96, 144], [1.1676, 0.6801, 0.5714]),
            "train (logged)": ([1, 50, 100], [1.77, 0.7963, 0.5965]),
            "valid": ([48, 96, 144], [0.98, 0.83, 0.68])}


def overlaps(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def check_text(lay):
    """Every text box inside the image, none overlapping another; the legend's own box
    overlaps only its entries, and everything tick-shaped lies inside the axis range."""
    w, h = lay.size
    for t in lay.texts:
        assert t.text and 0 <= t.box[0] < t.box[2] <= w and 0 <= t.box[1] < t.box[3] <= h, t
    for a, b in itertools.combinations(lay.texts, 2):
        assert not overlaps(a.box, b.box), (a, b)
    if lay.legend is not None:
        assert 0 <= lay.legend[0] and lay.legend[2] <= w and 0 <= lay.legend[1] and lay.legend[3] <= h
        for t in lay.texts:
            inside = all(lay.legend[i] <= t.box[i] for i in (0, 1)) and all(t.box[i] <= lay.legend[i] for i in (2, 3))
            assert inside if t.kind == "legend" else not overlaps(t.box, lay.legend), t
    x0, y0, x1, y1 = lay.frame
    axis = (lambda v: math.log10(v)) if lay.xlog else (lambda v: v)
    for v in lay.xticks:
        assert lay.xlim[0] <= axis(v) <= lay.xlim[1] and x0 - 0.5 <= lay.gx(v) <= x1 + 0.5
    for v in lay.yticks:
        assert lay.ylim[0] <= v <= lay.ylim[1] and y0 - 0.5 <= lay.gy(v) <= y1 + 0.5
    assert len({t.kind for t in lay.texts if t.kind in ("xlabel", "ylabel", "title")}) == len(
        [t for t in lay.texts if t.kind in ("xlabel", "ylabel", "title")])  # each once


def check_legend_clear(lay, series, marks=()):
    """No curve vertex, no point between two, and no mark line under the legend."""
    box = lay.legend
    assert box is not None
    for xs, ys in series.values():
        pts = [lay.px(x, y) for x, y in zip(xs, ys)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            for f in (0, 0.25, 0.5, 0.75, 1):
                x, y = ax + (bx - ax) * f, ay + (by - ay) * f
                assert not (box[0] <= x <= box[2] and box[1] <= y <= box[3]), (x, y, box)
    for x, _ in marks:
        assert not box[0] <= lay.gx(x) <= box[2]


def texts(lay, kind):
    return [t.text for t in lay.texts if t.kind == kind]


def test_lr_find_layout(font):
    series, marks = lr_find_inputs()
    lay = layout(series, title="lr_find", xlabel="learning rate (log)", ylabel="loss", xlog=True, marks=marks)
    check_text(lay)
    check_legend_clear(lay, series, marks)
    assert lay.xticks == [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    assert texts(lay, "xtick") == ["1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "1e0", "1e1"]
    # loss 1.4..2.4 padded by 5%: 1.35..2.45; step 0.2 gives 1.4..2.4
    assert lay.yticks == [1.4, 1.6, 1.8, 2.0, 2.2, 2.4]
    assert texts(lay, "ytick") == ["1.4", "1.6", "1.8", "2", "2.2", "2.4"]
    assert texts(lay, "legend") == ["loss", "smoothed loss", "slide 1.7e-01", "valley 3.0e-02",
                                    "steep 3.3e-02", "minimum 1.6e-02"]
    assert texts(lay, "title") == ["lr_find"] and texts(lay, "ylabel") == ["loss"]
    assert texts(lay, "xlabel") == ["learning rate (log)"]


def test_lr_find_plot_as_lr_find_draws_it(font):
    """The call in loop/lr_find.py: one series, the four suggestions as marks."""
    series, _ = lr_find_inputs()
    series = {"smoothed loss": series["smoothed loss"]}
    marks = [(2.1e-3, "valley 2.1e-03"), (3.3e-2, "steep 3.3e-02"), (1.6e-1, "minimum 1.6e-01"),
             (1.6e-2, "slide 1.6e-02")]
    lay = layout(series, title="lr_find", xlabel="learning rate (log)", ylabel="loss", xlog=True, marks=marks)
    check_text(lay)
    check_legend_clear(lay, series, marks)


def test_training_layout(font):
    series = training_inputs()
    lay = layout(series, title="loss", xlabel="step", ylabel="loss", xint=True,
                 note="train (logged) ends at step 100 of 144: read every 50 steps (log_every=50)")
    check_text(lay)
    check_legend_clear(lay, series)
    # steps 1..144: the axis starts at 0; at most ~11 ticks fit, step 20 gives 8
    assert lay.xticks == [0, 20, 40, 60, 80, 100, 120, 140]
    assert texts(lay, "xtick") == ["0", "20", "40", "60", "80", "100", "120", "140"]
    # 0.5714..1.77 padded by 5%: 0.511..1.830; step 0.2 gives 0.6..1.8
    assert lay.yticks == [0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8]
    assert texts(lay, "ytick") == ["0.6", "0.8", "1", "1.2", "1.4", "1.6", "1.8"]
    assert texts(lay, "note") == ["train (logged) ends at step 100 of 144: read every 50 steps (log_every=50)"]


def test_a_title_equal_to_the_ylabel_is_written_once(font):
    lay = layout(training_inputs(), title="loss", ylabel="loss", xlabel="step", xint=True)
    assert [t.text for t in lay.texts].count("loss") == 1
    lay = layout(training_inputs(), title="losses", ylabel="loss", xlabel="step", xint=True)
    assert texts(lay, "title") == ["losses"] and texts(lay, "ylabel") == ["loss"]


def test_constant_and_negative_series(font):
    # 2.5 +- 10% is 2.25..2.75, padded by 5%: 2.225..2.775; step 0.1 gives 2.3..2.7
    lay = layout({"flat": ([0, 1, 2], [2.5, 2.5, 2.5])})
    check_text(lay)
    assert lay.yticks == [2.3, 2.4, 2.5, 2.6, 2.7]
    assert texts(lay, "ytick") == ["2.3", "2.4", "2.5", "2.6", "2.7"]
    # 0 +- 1, padded: -1.1..1.1; step 0.5 gives -1..1
    lay = layout({"zero": ([0, 1], [0.0, 0.0])})
    assert texts(lay, "ytick") == ["-1", "-0.5", "0", "0.5", "1"]
    # -3.7..2.2 padded: -3.995..2.495; at most 8 ticks: step 1 gives -3..2
    lay = layout({"a": ([0, 1, 2], [-3.7, 0.0, 2.2])}, size=(640, 420))
    check_text(lay)
    assert lay.yticks == [-3, -2, -1, 0, 1, 2]
    assert texts(lay, "ytick") == ["-3", "-2", "-1", "0", "1", "2"]


def test_tiny_values_get_scientific_labels(font):
    # the lr schedule's tail: 2.02e-06..1e-3, padded: -4.79e-5..1.05e-3; step 2e-4 gives 0..1e-3
    lay = layout({"lr": ([1, 2, 3, 4], [1e-3, 5e-4, 1e-4, 2.02e-6])}, xint=True)
    check_text(lay)
    assert lay.yticks == [0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3]
    assert texts(lay, "ytick") == ["0", "2e-4", "4e-4", "6e-4", "8e-4", "1e-3"]
    assert texts(lay, "xtick") == ["1", "2", "3", "4"]  # whole steps only


def test_legend_moves_off_the_curves_or_out_of_the_frame(font):
    # rising to the top right: the legend goes elsewhere, but stays in the frame
    series = {"up": ([0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0]), "down": ([0, 3], [0.5, 0.4])}
    lay = layout(series)
    check_text(lay)
    check_legend_clear(lay, series)
    x0, y0, x1, y1 = lay.frame
    assert x0 < lay.legend[0] and lay.legend[2] < x1 and y0 < lay.legend[1] and lay.legend[3] < y1
    # ink in every corner and along every edge: beside the frame instead
    zigzag = {"a": (list(range(200)), [i % 2 for i in range(200)]), "b": ([0, 199], [0.5, 0.5])}
    lay = layout(zigzag, title="noise", xlabel="x", ylabel="y")
    check_text(lay)
    assert lay.legend[0] > lay.frame[2]


def test_no_finite_values():
    lay = layout({"loss": ([1, 2], [math.nan, math.inf])}, title="loss")
    assert texts(lay, "message") == ["no finite values to plot"] and lay.frame is None
    assert plot_lines({"loss": ([1, 2], [math.nan, math.inf])}).size == (640, 420)


def test_text_is_drawn_in_its_boxes(font):
    series, marks = lr_find_inputs()
    lay = layout(series, title="lr_find", xlabel="learning rate (log)", ylabel="loss", xlog=True, marks=marks)
    img = plots.draw(lay).convert("L")
    for t in lay.texts:
        assert img.crop(t.box).getextrema()[0] < 128, t  # some ink in every box
    img = plot_lines(series, title="lr_find", xlabel="learning rate (log)", ylabel="loss", xlog=True,
                     marks=marks).convert("L")
    assert img.tobytes() == plots.draw(lay).convert("L").tobytes()


# --- plot_history --------------------------------------------------------------------

def history(logged_steps, steps=144, epochs=3):
    h = History()
    h.lrs = [3e-3 * math.sin(math.pi * (i + 0.5) / steps) for i in range(steps)]
    h.logged = [(s, 2.0 / (1 + s / 30)) for s in logged_steps]
    h.epochs = [EpochStats(e, 1.2 - 0.3 * e, 1.0 - 0.1 * e, {}, h.lrs[-1], 1.0, 100.0, 0, 0) for e in range(epochs)]
    return h


def test_plot_history_notes_why_the_logged_curve_ends_early(tmp_path, monkeypatch):
    calls = []
    real = plots.layout
    monkeypatch.setattr(plots, "layout", lambda series, **kw: calls.append((series, kw)) or real(series, **kw))
    path = plot_history(history([1, 50, 100]), str(tmp_path / "training.png"))
    assert Image.open(path).size == (640, 840)
    notes = [kw.get("note") for series, kw in calls if "train (logged)" in series]
    assert notes and set(notes) == {"train (logged) ends at step 100 of 144: read every 50 steps (log_every=50)"}
    assert all(kw["xint"] for _, kw in calls)
    lr_steps = [s["learning rate"][0] for s, _ in calls if "learning rate" in s]
    assert lr_steps[0][0] == 1 and lr_steps[0][-1] == 144  # lrs[i] belongs to step i + 1
    assert not [f for f in os.listdir(tmp_path) if f != "training.png"]  # atomic: no temporary left


@pytest.mark.parametrize("logged, total, note", [
    ([1, 48, 96, 144], 144, ""),  # log_every=48 reaches the last step: nothing to explain
    ([1, 50, 100], 144, "train (logged) ends at step 100 of 144: read every 50 steps (log_every=50)"),
    ([1], 144, "train (logged) ends at step 1 of 144: read at step 1 only (log_every is None or over 144)"),
])
def test_logged_note(logged, total, note):
    assert plots._logged_note([(s, 1.0) for s in logged], total) == note


def test_plot_history_panels_share_their_left_edge(monkeypatch, tmp_path):
    frames = []
    real = plots.draw
    monkeypatch.setattr(plots, "draw", lambda lay: frames.append(lay.frame) or real(lay))
    plot_history(history([1, 50, 100]), str(tmp_path / "t.png"))
    assert len(frames) == 2 and frames[0][0] == frames[1][0] and frames[0][2] == frames[1][2]


def test_x_labels_that_would_touch_get_a_coarser_step(font):
    # 0..1e9 over ~575 px: at most 11 ticks by spacing alone, so step 1e8 (11 ticks, 57 px
    # apart); but "100000000" is 54 px wide, which leaves under 6 px between labels: 2e8
    lay = layout({"a": ([0, 1_000_000_000], [0.0, 1.0])}, xint=True)
    check_text(lay)
    assert lay.xticks == [0, 200_000_000, 400_000_000, 600_000_000, 800_000_000, 1_000_000_000]
    assert texts(lay, "xtick") == ["0", "200000000", "400000000", "600000000", "800000000", "1000000000"]


def test_small_images_stay_clean(font):
    series, marks = lr_find_inputs()
    lay = layout(series, title="lr_find", xlabel="learning rate (log)", ylabel="loss", xlog=True,
                 marks=marks, size=(320, 240))
    check_text(lay)
    # the six-line legend covers curves or marks everywhere: beside the frame, which keeps
    # about 140 px, room for 2 ticks: every fifth decade of 1e-7..10
    assert lay.legend[0] > lay.frame[2]
    assert lay.xticks == [1e-5, 1.0]
    lay = layout(training_inputs(), title="loss", xlabel="step", ylabel="loss", xint=True, size=(320, 240),
                 note="train (logged) ends at step 100 of 144")
    check_text(lay)
    check_legend_clear(lay, training_inputs())
    # about 285 px: at most 5 ticks; step 20 gives 8, step 50 gives 0, 50, 100
    assert lay.xticks == [0, 50, 100]
