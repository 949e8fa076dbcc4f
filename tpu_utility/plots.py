"""PNG plots drawn with Pillow (no matplotlib): line plots, and a training History's curves."""
from __future__ import annotations

from typing import Optional, Sequence

from .files import atomic_write


def plot_lines(series: dict, path: Optional[str] = None, *, title: str = "", xlabel: str = "",
               ylabel: str = "", xlog: bool = False, marks: Sequence = (), size=(640, 420)):
    """A line plot drawn with Pillow: `series` maps a name to (xs, ys).

    `marks` are (x, label) pairs drawn as vertical lines. Saved as a PNG when `path` is
    given; returns the PIL image either way.

    Example:
        >>> img = plot_lines({"loss": ([1, 2, 3], [3.0, 2.0, 2.5])}, title="loss")
        >>> img.size
        (640, 420)
    """
    import math
    from PIL import Image, ImageDraw
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    width, height = size
    left, right, top, bottom = 70, 20, 30, 45
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    tx = (lambda x: math.log10(x)) if xlog else (lambda x: x)
    points = [(tx(x), y) for xs, ys in series.values() for x, y in zip(xs, ys)
              if math.isfinite(y) and (not xlog or x > 0)]
    if not points:
        draw.text((left, height // 2), "no finite values to plot", fill="black")
    else:
        x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
        y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
        x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

        def px(x, y):
            return (left + (tx(x) - x0) / (x1 - x0) * (width - left - right),
                    top + (y1 - y) / (y1 - y0) * (height - top - bottom))

        draw.rectangle([left, top, width - right, height - bottom], outline="black")
        for i in range(5):  # axis ticks: 5 per axis
            fx, fy = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
            gx = left + (width - left - right) * i / 4
            gy = height - bottom - (height - top - bottom) * i / 4
            draw.line([gx, height - bottom, gx, height - bottom + 4], fill="black")
            draw.text((gx - 18, height - bottom + 6), f"{10 ** fx:.0e}" if xlog else f"{fx:.3g}", fill="black")
            draw.line([left - 4, gy, left, gy], fill="black")
            draw.text((4, gy - 6), f"{fy:.3g}", fill="black")
        for k, (name, (xs, ys)) in enumerate(series.items()):
            color = colors[k % len(colors)]
            line = [px(x, y) for x, y in zip(xs, ys) if math.isfinite(y) and (not xlog or x > 0)]
            if len(line) > 1:
                draw.line(line, fill=color, width=2)
            elif line:
                draw.ellipse([line[0][0] - 2, line[0][1] - 2, line[0][0] + 2, line[0][1] + 2], fill=color)
            draw.text((width - right - 120, top + 6 + 14 * k), name, fill=color)
        for j, (x, label) in enumerate(marks):
            if xlog and x <= 0:
                continue
            gx = px(x, y0)[0]
            color = colors[(len(series) + j) % len(colors)]
            draw.line([gx, top, gx, height - bottom], fill=color, width=1)
            draw.text((min(gx + 3, width - right - 80), top + 6 + 14 * (len(series) + j)), label, fill=color)
    draw.text((left, 8), title, fill="black")
    draw.text((width // 2 - 20, height - 16), xlabel, fill="black")
    draw.text((4, 8), ylabel, fill="black")
    if path is not None:
        save_png(img, path)
    return img


def save_png(img, path: str) -> str:
    """Write a PIL image as PNG atomically (temporary name, then rename)."""
    return atomic_write(path, lambda f: img.save(f, format="PNG"))


def plot_history(history, path: str) -> str:
    """Loss curves (per epoch and logged steps) over steps, and the lr schedule, as one PNG."""
    from PIL import Image
    steps = len(history.lrs) // max(1, len(history.epochs))
    losses = {"train (epoch)": ([(e.epoch + 1) * steps for e in history.epochs],
                                [e.train_loss for e in history.epochs])}
    if history.logged:
        losses["train (logged)"] = ([s for s, _ in history.logged], [v for _, v in history.logged])
    if history.epochs and history.epochs[0].valid_loss is not None:
        losses["valid"] = ([(e.epoch + 1) * steps for e in history.epochs], [e.valid_loss for e in history.epochs])
    top = plot_lines(losses, title="loss", xlabel="step", ylabel="loss")
    bottom = plot_lines({"lr": (list(range(len(history.lrs))), history.lrs)},
                        title="learning rate", xlabel="step")
    img = Image.new("RGB", (top.width, top.height + bottom.height), "white")
    img.paste(top, (0, 0))
    img.paste(bottom, (0, top.height))
    return save_png(img, path)
