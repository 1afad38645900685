"""The longest functions of a package (by source lines, decorators and docstring included).

    python tools/function_lengths.py [--root deepep_cupy/features] [--top 15] [--over 120]
"""

import argparse
import ast
import os


def _visit(node, path: str, prefix: str, rows: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([child.lineno] + [d.lineno for d in child.decorator_list])
            rows.append((child.end_lineno - first + 1, prefix + child.name, path, first))
            _visit(child, path, prefix + child.name + '.', rows)
        elif isinstance(child, ast.ClassDef):
            _visit(child, path, prefix + child.name + '.', rows)


def function_lengths(root: str):
    """`(lines, qualified name, path, first line)` of every function and method under `root`, longest first."""
    rows = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                with open(path, encoding='utf-8') as f:
                    _visit(ast.parse(f.read(), path), path, '', rows)
    return sorted(rows, key=lambda r: (-r[0], r[2], r[3]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', default=os.path.join('deepep_cupy', 'features'))
    parser.add_argument('--top', type=int, default=15)
    parser.add_argument('--over', type=int, default=120, help='also count the functions longer than this')
    args = parser.parse_args()
    rows = function_lengths(args.root)
    for lines, name, path, first in rows[:args.top]:
        print(f'{lines:5d}  {name:48s} {path}:{first}')
    print(f'{sum(1 for r in rows if r[0] > args.over)} of {len(rows)} functions longer than {args.over} lines')


if __name__ == '__main__':
    main()
