"""PNG plots drawn with Pillow (no matplotlib): line plots, and a training History's curves.

`layout` works out everything that is placed (axis ranges, ticks and their labels, the
legend, every text box) as plain numbers, so tests check it without looking at pixels;
`draw` paints a layout. Text is measured with the default font that the installed Pillow
has (a bitmap font before Pillow 10.1, a small TrueType one after): no font file is needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .files import atomic_write

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127)]
PAD = 6  # from the image's edge, and inside the legend
TICK = 4  # tick length, outward
GAP = 3  # between a tick and its label, and between stacked texts
SAMPLE = 18  # a legend entry's line
Box = Tuple[int, int, int, int]
Color = Tuple[int, int, int]


@dataclass
class Text:
    """One string and the box `(x0, y0, x1, y1)` its ink occupies (`xy`: where Pillow draws it)."""

    text: str
    box: Box
    kind: str  # title, xlabel, ylabel, xtick, ytick, legend, note, message
    xy: Tuple[int, int] = (0, 0)
    color: Tuple[int, int, int] = (0, 0, 0)
    rotated: bool = False  # drawn bottom to top (the y axis title)


@dataclass
class Layout:
    """Where everything goes: `plot_lines` draws it, tests read it.

    Ranges are in axis units (log10 of x on a log axis); `xticks` are data values.
    """

    size: Tuple[int, int]
    frame: Optional[Box]  # the plot area; None when nothing is finite
    xlim: Tuple[float, float] = (0.0, 1.0)
    ylim: Tuple[float, float] = (0.0, 1.0)
    xlog: bool = False
    xticks: List[float] = field(default_factory=list)
    yticks: List[float] = field(default_factory=list)
    texts: List[Text] = field(default_factory=list)
    legend: Optional[Box] = None
    legend_samples: List[Tuple[Box, Color, bool]] = field(default_factory=list)  # (line, color, dashed)
    lines: List[Tuple[str, Color, List[Tuple[float, float]]]] = field(default_factory=list)  # finite points
    marks: List[Tuple[float, str, Color]] = field(default_factory=list)
    font: Any = field(default=None, repr=False)

    def px(self, x: float, y: float) -> Tuple[float, float]:
        """The pixel of data point (x, y)."""
        return self.gx(x), self.gy(y)

    def gx(self, x: float) -> float:
        """The pixel column of data value x."""
        x0, _, x1, _ = self.frame
        ax = math.log10(x) if self.xlog else x
        return x0 + (ax - self.xlim[0]) / (self.xlim[1] - self.xlim[0]) * (x1 - x0)

    def gy(self, y: float) -> float:
        """The pixel row of data value y."""
        _, y0, _, y1 = self.frame
        return y1 - (y - self.ylim[0]) / (self.ylim[1] - self.ylim[0]) * (y1 - y0)


def nice_ticks(lo: float, hi: float, max_n: int = 7, *, integer: bool = False) -> List[float]:
    """The multiples of the finest step of 1, 2 or 5 times a power of ten that put at most
    `max_n` ticks in [lo, hi]; `integer`: steps of 1 or more.

    Example:
        >>> nice_ticks(0.593, 1.77)
        [0.6, 0.8, 1.0, 1.2, 1.4, 1.6]
        >>> nice_ticks(1, 144, integer=True)
        [20, 40, 60, 80, 100, 120, 140]
    """
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return []
    if hi == lo:
        return [] if integer and lo != int(lo) else [int(lo) if integer else lo]
    power = 10.0 ** math.floor(math.log10((hi - lo) / max(1, max_n)))
    for step in (m * power * 10 ** k for k in range(3) for m in (1, 2, 5)):
        if integer and step < 1:
            continue
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first + 1 <= max(1, max_n):
            # round: 3 * 0.2 is 0.6000000000000001, and the labels and tests want 0.6
            digits = max(0, -math.floor(math.log10(step))) + 1
            return [int(round(k * step)) if integer else round(k * step, digits)
                    for k in range(first, last + 1)]
    return []  # not reached: the last step above is over ten times the span


def log_ticks(lo: float, hi: float, max_n: int = 9) -> List[float]:
    """Ticks for a log axis over [lo, hi] (both > 0): decades (every 2nd, 5th... when there
    are too many), else 1, 2 and 5 times them, else `nice_ticks` of a range under a decade.

    Example:
        >>> log_ticks(1e-7, 8.3)
        [1e-07, 1e-06, 1e-05, 0.0001, 0.001, 0.01, 0.1, 1.0]
        >>> log_ticks(0.003, 0.06)
        [0.005, 0.01, 0.02, 0.05]
    """
    a, b = math.log10(lo), math.log10(hi)
    k0, k1 = math.ceil(a - 1e-9), math.floor(b + 1e-9)
    if k1 > k0:
        for every in (1, 2, 5, 10, 20, 50, 100):
            ks = [k for k in range(k0, k1 + 1) if k % every == 0]
            if len(ks) <= max_n:
                return [float(f"1e{k}") for k in ks]  # the nearest float, whatever the C library's pow
    for mantissas in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [float(f"{m}e{k}") for k in range(k0 - 1, k1 + 1) for m in mantissas]
        ticks = [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
        if 2 <= len(ticks) <= max_n:
            return ticks
    return nice_ticks(lo, hi, max_n)


def tick_labels(values: Sequence[float], *, integer: bool = False) -> List[str]:
    """Labels with the fewest digits that still say each value exactly: decimals, or
    "2e-6" style where that is shorter (very small or large values); never "-0".

    Example:
        >>> tick_labels([0.5, 1.0, 1.5])
        ['0.5', '1', '1.5']
        >>> tick_labels([0.0, 2e-4, 4e-4])
        ['0', '2e-4', '4e-4']
        >>> tick_labels([1e-07, 1e-06, 1e-05])
        ['1e-7', '1e-6', '1e-5']
    """
    decimal = [_decimal(v) for v in values]
    if integer or not values:
        return decimal
    scientific = [_scientific(v) for v in values]
    return decimal if max(map(len, decimal)) <= max(map(len, scientific)) else scientific


def _exact_digits(v: float, most: int = 15) -> int:
    """The fewest decimals that write `v` (a tick: a short decimal) without changing it."""
    for d in range(most + 1):
        if abs(round(v, d) - v) <= 1e-9 * max(abs(v), 1e-300):
            return d
    return most


def _decimal(v: float) -> str:
    if v == 0:
        return "0"
    d = _exact_digits(v)
    return f"{v:.{d}f}"


def _scientific(v: float) -> str:
    if v == 0:
        return "0"
    e = math.floor(math.log10(abs(v)))
    m = v / 10 ** e
    d = _exact_digits(m, 6)
    if abs(round(m, d)) >= 10:  # 9.9999 rounded up: one decade more
        e, m = e + 1, m / 10
        d = _exact_digits(m, 6)
    return f"{m:.{d}f}e{e}"


def _default_font():
    from PIL import ImageFont
    return ImageFont.load_default()


class _Measure:
    """Text boxes from the font itself: `textbbox`, or `getsize` where Pillow < 9.2 has no
    bbox for bitmap fonts."""

    def __init__(self, font):
        from PIL import Image, ImageDraw
        self.font = font
        self.draw = ImageDraw.Draw(Image.new("L", (1, 1)))
        _, self.top, _, bottom = self.bbox("Ag")  # a line's ascent and descent, whatever its letters
        self.height = bottom - self.top

    def bbox(self, s: str) -> Box:
        try:
            return tuple(int(round(v)) for v in self.draw.textbbox((0, 0), s, font=self.font))
        except (AttributeError, ValueError):
            w, h = self.font.getsize(s)
            return (0, 0, w, h)

    def width(self, s: str) -> int:
        l, _, r, _ = self.bbox(s)
        return r - l

    def text(self, s: str, x: float, y: float, kind: str, color=(0, 0, 0), anchor: str = "l") -> Text:
        """`s` with its line (the font's "Ag" height) starting at y; x is its left edge,
        centre or right edge by `anchor`: rows of labels share a baseline."""
        l, t, r, b = self.bbox(s)
        left = {"l": x, "c": x - (r - l) / 2, "r": x - (r - l)}[anchor]
        ox, oy = int(round(left - l)), int(round(y - self.top))
        return Text(s, (ox + l, oy + t, ox + r, oy + b), kind, (ox, oy), color)

    def centred(self, s: str, x: float, y: float, kind: str, width: int) -> Text:
        """`s` centred on x, but moved in to stay inside an image `width` wide."""
        half = self.width(s) / 2
        return self.text(s, min(max(x, PAD + half), width - PAD - half), y, kind, anchor="c")

    def rotated(self, s: str, x: float, y_center: float, kind: str) -> Text:
        l, t, r, b = self.bbox(s)
        x0, y0 = int(round(x)), int(round(y_center - (r - l) / 2))
        return Text(s, (x0, y0, x0 + (b - t), y0 + (r - l)), kind, (x0, y0), rotated=True)

    def fit(self, s: str, width: float) -> str:
        """`s`, cut with "..." to `width` pixels: a long title must not leave the image."""
        if self.width(s) <= width:
            return s
        while s and self.width(s + "...") > width:
            s = s[:-1]
        return s + "..." if s else ""


def layout(series: Dict[str, Tuple[Sequence[float], Sequence[float]]], *, title: str = "",
           xlabel: str = "", ylabel: str = "", xlog: bool = False, xint: bool = False,
           marks: Sequence[Tuple[float, str]] = (), note: str = "",
           size: Tuple[int, int] = (640, 420), min_left: int = 0) -> Layout:
    """Place a line plot: ranges, ticks and labels, legend; see `plot_lines` for the arguments.

    `min_left` widens the left margin (plots stacked with aligned axes). Non-finite points
    (and x <= 0 on a log axis) are left out. The legend goes in the frame's corner that
    covers no curve and no mark, or beside the frame when every corner would.

    Example:
        >>> lay = layout({"loss": ([1, 2, 3], [3.0, 2.0, 2.5])}, title="loss")
        >>> lay.yticks, [t.text for t in lay.texts if t.kind == "ytick"]
        ([2.0, 2.2, 2.4, 2.6, 2.8, 3.0], ['2', '2.2', '2.4', '2.6', '2.8', '3'])
    """
    w, h = size
    m = _Measure(_default_font())
    lh = m.height
    kept = lambda x, y: math.isfinite(x) and math.isfinite(y) and (x > 0 or not xlog)
    lines = [(name, COLORS[k % len(COLORS)],
              [(float(x), float(y)) for x, y in zip(xs, ys) if kept(x, y)])
             for k, (name, (xs, ys)) in enumerate(series.items())]
    marks_kept = [(float(x), label, COLORS[(len(series) + j) % len(COLORS)])
                  for j, (x, label) in enumerate(marks) if kept(x, 0.0)]
    if ylabel == title:  # the same word in the corner and on the axis says it twice
        ylabel = ""
    lay = Layout(size, None, xlog=xlog, lines=lines, marks=marks_kept, font=m.font)
    title = m.fit(title, w - 2 * PAD)
    top = PAD + (lh + 2 * GAP if title else 0)
    tx = math.log10 if xlog else float
    xs = [tx(x) for _, _, pts in lines for x, _ in pts] + [tx(x) for x, _, _ in marks_kept]
    ys = [y for _, _, pts in lines for _, y in pts]
    if not ys:
        lay.texts.append(m.text("no finite values to plot", w / 2, h / 2, "message", anchor="c"))
        if title:
            lay.texts.append(m.text(title, w / 2, PAD, "title", anchor="c"))
        return lay
    xlo, xhi = _widen(min(xs), max(xs), 0.5 if xlog else None)
    if xint and 0 < xlo <= 0.05 * (xhi - xlo):  # steps counted from 1: the axis from 0 gets a 0 tick
        xlo = 0.0
    ylo, yhi = _widen(min(ys), max(ys))
    ylo, yhi = ylo - 0.05 * (yhi - ylo), yhi + 0.05 * (yhi - ylo)  # curves clear of the frame

    top += (lh + 1) // 2 + GAP  # the top y label is centred on the frame's edge
    bottom = h - PAD - (lh + GAP if note else 0) - (lh + 2 * GAP if xlabel else 0) - (TICK + GAP + lh)
    ticks = []
    for n in range(max(2, (bottom - top) // 40), 0, -1):  # rows of labels at least a line apart
        ticks = nice_ticks(ylo, yhi, n)
        if len(ticks) < 2 or (bottom - top) * (ticks[1] - ticks[0]) / (yhi - ylo) >= lh + GAP:
            break
    lay.yticks = ticks
    lay.ylim = (min([ylo] + ticks), max([yhi] + ticks))
    ylabels = tick_labels(ticks)
    left = PAD + (lh + 2 * GAP if ylabel else 0) + max(map(m.width, ylabels), default=0) + GAP + TICK
    left = max(left, min_left)

    legend = _legend_entries(lines, marks_kept, title, ylabel)
    legend_w = PAD + SAMPLE + 2 * GAP + max((m.width(s) for s, _, _ in legend), default=0) + PAD
    legend_h = PAD + len(legend) * (lh + GAP) - GAP + PAD
    outside = False
    for _ in range(2):  # a second pass when the legend has to move beside the frame
        right = w - PAD - (legend_w + 2 * PAD if outside else 0)
        right, xticks, xlabels = _x_ticks(m, xlo, xhi, left, right, w, xlog, xint)
        lay.frame, lay.xticks = (left, top, right, bottom), xticks
        lay.xlim = (min([xlo] + [tx(t) for t in xticks]), max([xhi] + [tx(t) for t in xticks]))
        if not legend:
            break
        box = ((w - PAD - legend_w, top, w - PAD, top + legend_h) if outside
               else _legend_corner(lay, legend_w, legend_h))
        if box is not None:
            break
        outside = True

    texts = lay.texts
    middle = (left + lay.frame[2]) / 2
    if title:
        texts.append(m.centred(title, middle, PAD, "title", w))
    for v, s in zip(lay.yticks, ylabels):
        texts.append(m.text(s, left - TICK - GAP, lay.gy(v) - lh / 2, "ytick", anchor="r"))
    for v, s in zip(lay.xticks, xlabels):
        texts.append(m.text(s, lay.gx(v), bottom + TICK + GAP, "xtick", anchor="c"))
    row = bottom + TICK + GAP + lh + 2 * GAP
    if xlabel:
        texts.append(m.centred(m.fit(xlabel, w - 2 * PAD), middle, row, "xlabel", w))
        row += lh + GAP
    if note:
        texts.append(m.text(m.fit(note, w - 2 * PAD), PAD, row, "note", color=(90, 90, 90)))
    if ylabel:
        texts.append(m.rotated(m.fit(ylabel, bottom - top), PAD, (top + bottom) / 2, "ylabel"))
    if legend:
        lay.legend = box
        for i, (s, color, dashed) in enumerate(legend):
            y = box[1] + PAD + i * (lh + GAP)
            sample_y = int(y + lh / 2)
            lay.legend_samples.append(((box[0] + PAD, sample_y, box[0] + PAD + SAMPLE, sample_y), color, dashed))
            texts.append(m.text(s, box[0] + PAD + SAMPLE + 2 * GAP, y, "legend"))
    return lay


def _widen(lo: float, hi: float, half: Optional[float] = None) -> Tuple[float, float]:
    """A range for constant data: around the value, never empty."""
    if hi > lo:
        return lo, hi
    half = half if half is not None else (abs(lo) * 0.1 or 1.0)
    return lo - half, hi + half


def _x_ticks(m: _Measure, lo: float, hi: float, left: int, right: int, w: int, xlog: bool, xint: bool):
    """As many x ticks as fit with their labels apart, and a right edge that leaves room
    for the last label: (right, ticks, labels)."""
    for _ in range(3):  # the right margin depends on the last label, the labels on the width
        best = ([], [])
        for n in range(max(2, (right - left) // 50), 0, -1):
            ticks = log_ticks(10 ** lo, 10 ** hi, n) if xlog else nice_ticks(lo, hi, n, integer=xint)
            labels = tick_labels(ticks, integer=xint)
            at = [left + ((math.log10(t) if xlog else t) - lo) / (hi - lo) * (right - left) for t in ticks]
            spans = [(x - m.width(s) / 2, x + m.width(s) / 2) for x, s in zip(at, labels)]
            best = (ticks, labels)
            apart = all(a[1] + 2 * GAP <= b[0] for a, b in zip(spans, spans[1:]))
            if apart and (not spans or spans[0][0] >= PAD):
                break
        ticks, labels = best
        half = m.width(labels[-1]) / 2 if labels else 0
        last = (math.log10(ticks[-1]) if xlog else ticks[-1]) if ticks else lo
        overhang = left + (last - lo) / (hi - lo) * (right - left) + half - (w - PAD)
        if overhang <= 0:
            return right, ticks, labels
        right -= int(math.ceil(overhang))
    return right, ticks, labels


def _legend_entries(lines, marks, title: str, ylabel: str) -> List[Tuple[str, Tuple[int, int, int], bool]]:
    """(name, color, dashed) per curve and per mark; none for a lone curve that the title
    or the axis title already names."""
    entries = ([(name, color, False) for name, color, _ in lines if name]
               + [(label, color, True) for _, label, color in marks if label])
    if len(entries) == 1 and not marks and entries[0][0].lower() in (title.lower(), ylabel.lower()):
        return []
    return entries


def _legend_corner(lay: Layout, lw: int, lh: int) -> Optional[Box]:
    """The first of matplotlib's "best" places in the frame where the legend covers no curve
    and no mark, or None."""
    x0, y0, x1, y1 = lay.frame
    if lw > x1 - x0 - 2 * PAD or lh > y1 - y0 - 2 * PAD:
        return None
    xs = {"l": x0 + PAD, "c": (x0 + x1 - lw) // 2, "r": x1 - PAD - lw}
    ys = {"t": y0 + PAD, "m": (y0 + y1 - lh) // 2, "b": y1 - PAD - lh}
    ink = _ink(lay)
    for v, u in (("t", "r"), ("t", "l"), ("b", "l"), ("b", "r"), ("m", "r"), ("m", "l"), ("b", "c"),
                 ("t", "c"), ("m", "c")):
        box = (xs[u], ys[v], xs[u] + lw, ys[v] + lh)
        if not any(box[0] - PAD <= x <= box[2] + PAD and box[1] - PAD <= y <= box[3] + PAD for x, y in ink):
            return box
    return None


def _ink(lay: Layout) -> List[Tuple[float, float]]:
    """Pixels along every curve and mark, no more than 3 px apart."""
    out = []
    for _, _, pts in lay.lines:
        p = [lay.px(x, y) for x, y in pts]
        out += p[:1]
        for (ax, ay), (bx, by) in zip(p, p[1:]):
            n = max(1, int(math.hypot(bx - ax, by - ay) / 3))
            out += [(ax + (bx - ax) * i / n, ay + (by - ay) * i / n) for i in range(1, n + 1)]
    x0, y0, x1, y1 = lay.frame
    for x, _, _ in lay.marks:
        out += [(lay.gx(x), y) for y in range(y0, y1 + 1, 3)]
    return out


def draw(lay: Layout):
    """Paint a `Layout` on a white image; returns the PIL image.

    Example:
        >>> draw(layout({"a": ([0, 1], [0, 1])}, size=(200, 150))).size
        (200, 150)
    """
    from PIL import Image, ImageDraw
    img = Image.new("RGB", lay.size, "white")
    d = ImageDraw.Draw(img)
    if lay.frame is not None:
        x0, y0, x1, y1 = lay.frame
        for x, _, color in lay.marks:
            gx = round(lay.gx(x))
            _dashed(d, (gx, y0, gx, y1), color)
        for _, color, pts in lay.lines:
            p = [lay.px(x, y) for x, y in pts]
            if len(p) > 1:
                d.line(p, fill=color, width=2, joint="curve")
            elif p:
                d.ellipse([p[0][0] - 2, p[0][1] - 2, p[0][0] + 2, p[0][1] + 2], fill=color)
        d.rectangle(lay.frame, outline="black")
        for v in lay.yticks:
            gy = round(lay.gy(v))
            d.line([x0 - TICK, gy, x0, gy], fill="black")
        for v in lay.xticks:
            gx = round(lay.gx(v))
            d.line([gx, y1, gx, y1 + TICK], fill="black")
        if lay.legend is not None:
            d.rectangle(lay.legend, fill="white", outline=(200, 200, 200))
            for line, color, dashed in lay.legend_samples:
                _dashed(d, line, color) if dashed else d.line(line, fill=color, width=2)
    for t in lay.texts:
        if t.rotated:
            _draw_rotated(img, t, lay.font)
        else:
            d.text(t.xy, t.text, fill=t.color, font=lay.font)
    return img


def _dashed(d, line: Box, color, on: int = 5, off: int = 3) -> None:
    x0, y0, x1, y1 = line
    length = math.hypot(x1 - x0, y1 - y0)
    at = 0.0
    while at < length:
        end = min(at + on, length)
        d.line([x0 + (x1 - x0) * at / length, y0 + (y1 - y0) * at / length,
                x0 + (x1 - x0) * end / length, y0 + (y1 - y0) * end / length], fill=color, width=1)
        at = end + off


def _draw_rotated(img, t: Text, font) -> None:
    from PIL import Image, ImageDraw
    m = _Measure(font)
    l, tp, r, b = m.bbox(t.text)
    strip = Image.new("L", (r - l, b - tp), 0)
    ImageDraw.Draw(strip).text((-l, -tp), t.text, fill=255, font=font)
    strip = strip.rotate(90, expand=True)
    img.paste(t.color, (t.box[0], t.box[1], t.box[0] + strip.width, t.box[1] + strip.height), strip)


def plot_lines(series: dict, path: Optional[str] = None, *, title: str = "", xlabel: str = "",
               ylabel: str = "", xlog: bool = False, marks: Sequence = (), size=(640, 420),
               xint: bool = False, note: str = ""):
    """A line plot drawn with Pillow: `series` maps a name to (xs, ys).

    `marks` are (x, label) pairs drawn as dashed vertical lines, named in the legend.
    `xlog`: log x axis with decade ticks; `xint`: whole-number x ticks (steps, epochs);
    `note`: a line under the plot. Saved as a PNG when `path` is given; returns the PIL
    image either way.

    Example:
        >>> img = plot_lines({"loss": ([1, 2, 3], [3.0, 2.0, 2.5])}, title="loss")
        >>> img.size
        (640, 420)
    """
    img = draw(layout(series, title=title, xlabel=xlabel, ylabel=ylabel, xlog=xlog, xint=xint,
                      marks=marks, note=note, size=size))
    if path is not None:
        save_png(img, path)
    return img


def save_png(img, path: str) -> str:
    """Write a PIL image as PNG atomically (temporary name, then rename).

    Example:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> path = save_png(Image.new("RGB", (4, 3)), os.path.join(tempfile.mkdtemp(), "a.png"))
        >>> Image.open(path).size
        (4, 3)
    """
    return atomic_write(path, lambda f: img.save(f, format="PNG"))


def plot_history(history, path: str) -> str:
    """Loss curves (per epoch and logged steps) over steps, and the lr schedule, as one PNG.

    Example:
        >>> import os, tempfile
        >>> from tpu_utility.loop.state import EpochStats, History
        >>> h = History(epochs=[EpochStats(0, 0.9, 0.8, {}, 1e-3, 1.0, 10.0, 0, 0)],
        ...             lrs=[1e-3, 2e-3, 1e-3, 1e-5], logged=[(1, 1.2)])
        >>> path = plot_history(h, os.path.join(tempfile.mkdtemp(), "training.png"))
        >>> from PIL import Image; Image.open(path).size
        (640, 840)
    """
    from PIL import Image
    steps = len(history.lrs) // max(1, len(history.epochs))
    losses = {"train (epoch)": ([(e.epoch + 1) * steps for e in history.epochs],
                                [e.train_loss for e in history.epochs])}
    if history.logged:
        losses["train (logged)"] = ([s for s, _ in history.logged], [v for _, v in history.logged])
    if history.epochs and history.epochs[0].valid_loss is not None:
        losses["valid"] = ([(e.epoch + 1) * steps for e in history.epochs], [e.valid_loss for e in history.epochs])
    # lrs[i] is the lr of step i + 1: the same step numbers as `logged`, so the axes match
    lrs = {"learning rate": (list(range(1, len(history.lrs) + 1)), history.lrs)}
    top_kw = dict(title="loss", xlabel="step", ylabel="loss", xint=True,
                  note=_logged_note(history.logged, len(history.lrs)))
    bottom_kw = dict(title="learning rate", xlabel="step", xint=True)
    top, bottom = layout(losses, **top_kw), layout(lrs, **bottom_kw)
    if top.frame and bottom.frame and top.frame[0] != bottom.frame[0]:  # one left edge: the step axes line up
        left = max(top.frame[0], bottom.frame[0])
        top, bottom = layout(losses, **top_kw, min_left=left), layout(lrs, **bottom_kw, min_left=left)
    top_img, bottom_img = draw(top), draw(bottom)
    img = Image.new("RGB", (top_img.width, top_img.height + bottom_img.height), "white")
    img.paste(top_img, (0, 0))
    img.paste(bottom_img, (0, top_img.height))
    return save_png(img, path)


def _logged_note(logged: Sequence[Tuple[int, float]], total: int) -> str:
    """Why the logged curve ends before the run does: it is read only every `log_every`
    steps (and at step 1), and the last read can fall up to `log_every - 1` steps short."""
    if not logged or logged[-1][0] >= total:
        return ""
    every = 0
    for step, _ in logged:
        if step > 1:
            every = math.gcd(every, int(step))
    how = (f"read every {every} steps (log_every={every})" if every else
           f"read at step 1 only (log_every is None or over {total})")
    return f"train (logged) ends at step {logged[-1][0]} of {total}: {how}"
