"""A lint of the CUDA sources: no warp collective inside a lane-strided loop.

A loop whose trip count is the lane's (`for (int c = begin + lane; c < end; c += 32)`) runs fewer passes on some lanes
when the range does not fill the last pass; a `__shfl_sync` / `__ballot_sync` / `__any_sync` / `__all_sync` over the
whole warp inside it (directly, or through a lambda or device function that makes one) then waits for lanes that left
the loop. ep_combine.cu's expanded combine hung that way at hidden 128 (16 chunks per row) on the GPU; its loops are
warp-uniform passes now. This finds the pattern in every source the package compiles."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / 'kernels_cu').rglob('*.cu')) + sorted((ROOT / 'kernels_cu').rglob('*.cuh'))
COLLECTIVE = re.compile(r'__(shfl|shfl_up|shfl_down|shfl_xor|ballot|any|all|match_any|match_all)_sync\s*\(')
# for (int v = <... lane ...>; v < ...; v += 32 ...)
LANE_LOOP = re.compile(r'for\s*\(\s*int\s+(\w+)\s*=\s*[^;]*\blane\b[^;]*;\s*\1\s*<[^;]*;\s*\1\s*\+=\s*32\b[^)]*\)\s*')
# `const auto name = [&](...) { ... __shfl_sync ... };` on one line
SHUFFLING_LAMBDA = re.compile(r'auto\s+(\w+)\s*=\s*\[[^\]]*\]\s*\([^)]*\)\s*\{[^\n]*__\w+_sync\s*\(')
DEVICE_FUNCTION = re.compile(r'__device__[^;{(]*?\b(\w+)\s*\([^;{]*\)\s*(?:const\s*)?\{')
# Device functions that call a function argument per row or slot (which the callers' lambdas make shuffle)
CALLS_ITS_FUNCTION_ARGUMENT = {'sum_local_rows'}


def _block(text: str, open_at: int) -> str:
    """The text from the brace at `open_at` to its matching brace."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {'{': 1, '}': -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at:i + 1]
    return text[open_at:]


def _loop_body(text: str, end_of_header: int) -> str:
    """A for loop's body: a braced block, or the one statement up to its semicolon."""
    if text[end_of_header] == '{':
        return _block(text, end_of_header)
    return text[end_of_header:text.index(';', end_of_header) + 1]


def shuffling_names(text: str) -> set:
    """Device functions and lambdas of `text` whose bodies make a warp collective (one level deep)."""
    names = set(SHUFFLING_LAMBDA.findall(text)) | CALLS_ITS_FUNCTION_ARGUMENT
    for m in DEVICE_FUNCTION.finditer(text):
        if COLLECTIVE.search(_block(text, m.end() - 1)):
            names.add(m.group(1))
    return names


def divergent_collectives(text: str, helpers: set) -> list:
    """(line, loop header) of each lane-strided loop of `text` whose body makes a warp collective."""
    calls = re.compile(r'\b(' + '|'.join(sorted(helpers)) + r')\s*(<[^;()]*>)?\s*\(') if helpers else None
    found = []
    for m in LANE_LOOP.finditer(text):
        body = _loop_body(text, m.end())
        if COLLECTIVE.search(body) or (calls is not None and calls.search(body)):
            found.append((text.count('\n', 0, m.start()) + 1, m.group(0).strip()))
    return found


def test_the_lint_finds_the_pattern_that_hung():
    """The expanded combine's loop as it was (a lambda that shuffles, called per chunk of the lane) and a direct
    shuffle; the warp-uniform form passes."""
    before = """
        const auto local_row = [&](int k) { return __shfl_sync(0xffffffffu, row, k); };
        for (int c = c_begin + lane; c < c_end; c += 32)
            st_na_v4(dst + c * 16, sum_local_rows<kMaxTopk>(x, row_bytes, c, rows_mask, local_row));
        for (int c = lane; c < n; c += 32) {
            v = __shfl_sync(0xffffffffu, v, 0);
        }
    """
    helpers = shuffling_names(before)
    assert [line for line, _ in divergent_collectives(before, helpers)] == [3, 5]
    after = """
        for (int c0 = c_begin; c0 < c_end; c0 += 32) {
            const int c = min(c0 + lane, c_end - 1);
            const Vec16 v = sum_local_rows<kMaxTopk>(x, row_bytes, c, rows_mask, local_row);
        }
    """
    assert divergent_collectives(after, helpers) == []


def test_no_warp_collective_in_a_lane_strided_loop():
    assert SOURCES, 'no kernel sources found'
    texts = {p: p.read_text() for p in SOURCES}
    helpers = set().union(*(shuffling_names(t) for t in texts.values()))
    assert {'x_row_of', 'slot_of', 'local_row', 'topk_owners'} <= helpers    # (ep_combine.cu's, common/ep.cuh's)
    found = [f'{p.relative_to(ROOT)}:{line}: {header}' for p, t in texts.items()
             for line, header in divergent_collectives(t, helpers)]
    assert not found, 'warp collectives inside lane-strided loops:\n' + '\n'.join(found)
