"""Every kernel interface checked against its one source of truth, the C++ signature, without a compiler.

    python tools/kernel_interfaces.py       # every shipped KernelSpec against its kernel; exit status 1 on a mismatch

Each kernel's parameters are declared twice: in C++ (`kernels_cu/<family>.cu`) and in Python (a `KernelSpec`, whose
launchers bind arguments by name and pack them by kind). This module reads the C++ side with a small parser and
compares, for every spec, the kernel's name, its template arguments (count and kind: `int` / `bool` values,
`typename` types) and its parameter list (names, order, pointer or scalar, and the scalar's exact width and
signedness). tests/test_kernel_interfaces_cpu.py runs it; tests/test_peer_copy.py keeps an NVRTC probe of one
specialisation per family as a second opinion.

The parser: comments and string literals go first; preprocessor lines are read as NVRTC would for this tree
(`#include "..."` splices the included file in place, once per translation unit, resolved against the kernels'
root, then the including file's folder; object-like `#define`s are substituted; function-like macros, `#pragma` and
conditionals are dropped: the tree has no conditional code). The tokens then give namespaces (nested, `a::b`,
anonymous), `extern "C"`, `template <...>` heads, `typedef` / `using` aliases, namespace-scope `constexpr` scalars
and every `__global__` function with `__launch_bounds__` or attributes skipped. A parameter's type loses `const`,
`volatile` and `__restrict__`; typedefs are resolved (`int64_t` -> `long long`) and `typename` template parameters
replaced by the name expression's arguments before the type is mapped to a numpy scalar name.
"""

import argparse
import ast
import operator
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / 'kernels_cu'

_TOKEN = re.compile(r'''
    (?P<str>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<num>0[xX][0-9a-fA-F]+[uUlL]*|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[uUlLfF]*)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<op>\.\.\.|::|->|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|[-+*/%&|^~!=<>?:;,.(){}\[\]#@$\\])
''', re.VERBOSE)
_QUALIFIERS = frozenset({'const', 'volatile', '__restrict__', '__restrict', 'restrict', 'register', 'struct',
                         '__grid_constant__'})
_ATTRIBUTES = frozenset({'__launch_bounds__', '__attribute__', '__declspec', '__align__', 'alignas', '__maxnreg__',
                         '__cluster_dims__'})
_DECL_WORDS = frozenset({'static', 'inline', '__forceinline__', '__noinline__', '__device__', '__host__', 'void',
                         'extern'})
_INT_WORDS = frozenset({'signed', 'unsigned', 'short', 'long', 'int', 'char'})


@dataclass(frozen=True)
class Token:
    text: str
    path: str
    line: int


@dataclass(frozen=True)
class CParam:
    """One kernel parameter as written: `name`, the type's tokens (qualifiers kept, for messages), whether it is a
    pointer (or an array), and its base type's tokens without qualifiers (before typedefs are resolved)."""
    name: str
    spelling: str
    pointer: bool
    base: Tuple[str, ...]
    reference: bool = False


@dataclass(frozen=True)
class CKernel:
    """A `__global__` function: its qualified name, template parameters `(kind, name, has_default)`, parameters and
    where it is declared."""
    qualname: str
    template: Optional[Tuple[Tuple[str, str, bool], ...]]
    params: Tuple[CParam, ...]
    path: str
    line: int
    extern_c: bool = False

    @property
    def where(self) -> str:
        return f'{self.path}:{self.line}'


@dataclass
class Source:
    """What the parser found in one translation unit (a family's `.cu` and everything it includes)."""
    kernels: Dict[str, List[CKernel]] = field(default_factory=dict)
    typedefs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    constants: Dict[str, object] = field(default_factory=dict)       # name -> value (int / float), or None
    conflicts: Dict[str, List[object]] = field(default_factory=dict)  # names defined with different values
    files: List[str] = field(default_factory=list)

    def constant(self, name: str):
        """The value of namespace-scope `constexpr` `name` (KeyError if absent, ValueError if defined twice with
        different values or not a constant expression the parser evaluates)."""
        if name in self.conflicts:
            raise ValueError(f'{name} is defined with different values {self.conflicts[name]}')
        value = self.constants[name]
        if value is None:
            raise ValueError(f'{name} is not a constant expression of literals and earlier constants')
        return value

    def resolve(self, words: Sequence[str], subst: Optional[Dict[str, Tuple[str, ...]]] = None) -> Tuple[str, ...]:
        """A base type's words with `typename` substitutions and typedefs applied (to a fixed point)."""
        out = tuple(words)
        for _ in range(16):
            nxt: List[str] = []
            for w in out:
                if subst and w in subst:
                    nxt.extend(subst[w])
                elif w in self.typedefs:
                    nxt.extend(self.typedefs[w])
                else:
                    nxt.append(w)
            nxt_t = tuple(w for w in nxt if w not in _QUALIFIERS)
            if nxt_t == out:
                break
            out = nxt_t
        return out


# ---- reading the source ---------------------------------------------------------------------------------------------
def strip_comments(text: str) -> str:
    """`text` without `//` and `/* */` comments (newlines kept, so lines still count), string literals untouched."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in '"\'':
            j = i + 1
            while j < n and text[j] != c and text[j] != '\n':
                j += 2 if text[j] == '\\' else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith('//', i):
            j = text.find('\n', i)
            i = n if j < 0 else j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(' ' + '\n' * text.count('\n', i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def tokenize(text: str, path: str = '<source>', first_line: int = 1) -> List[Token]:
    tokens, line, pos = [], first_line, 0
    for m in _TOKEN.finditer(text):
        line += text.count('\n', pos, m.start())
        pos = m.start()
        tokens.append(Token(m.group(), path, line))
    return tokens


class _Preprocessor:
    """Splices includes and substitutes object-like macros, producing one token list per translation unit."""

    def __init__(self, root: Path):
        self.root = root
        self.seen: List[Path] = []
        self.macros: Dict[str, List[str]] = {}

    def run(self, path: Path) -> List[Token]:
        path = path.resolve()
        if path in self.seen:
            return []
        self.seen.append(path)
        rel = _display(path, self.root)
        lines = strip_comments(path.read_text()).split('\n')
        out: List[Token] = []
        i = 0
        while i < len(lines):
            first, text = i, lines[i]
            while text.endswith('\\') and i + 1 < len(lines):     # continuation lines
                i += 1
                text = text[:-1] + ' ' + lines[i]
            i += 1
            stripped = text.strip()
            if stripped.startswith('#'):
                out.extend(self._directive(stripped[1:].strip(), path))
                continue
            out.extend(self._expand(tokenize(text, rel, first + 1)))
        return out

    def _directive(self, text: str, path: Path) -> List[Token]:
        m = re.match(r'include\s*"([^"]+)"', text)
        if m:
            for base in (self.root, path.parent):
                candidate = base / m.group(1)
                if candidate.is_file():
                    return self.run(candidate)
            raise FileNotFoundError(f'{path}: #include "{m.group(1)}" not found under {self.root}')
        m = re.match(r'define\s+([A-Za-z_]\w*)(\(?)(.*)$', text)
        if m:
            if not m.group(2):          # object-like; function-like ones are dropped (the tree uses them in asserts)
                self.macros[m.group(1)] = [t.text for t in tokenize(m.group(3))]
            return []
        m = re.match(r'undef\s+([A-Za-z_]\w*)', text)
        if m:
            self.macros.pop(m.group(1), None)
        return []

    def _expand(self, tokens: List[Token], depth: int = 0) -> List[Token]:
        if not self.macros or depth > 8:
            return tokens
        out, changed = [], False
        for t in tokens:
            body = self.macros.get(t.text)
            if body is None:
                out.append(t)
            else:
                out.extend(Token(b, t.path, t.line) for b in body)
                changed = True
        return self._expand(out, depth + 1) if changed else out


def _display(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _matching(tokens: Sequence[Token], i: int, open_: str, close: str) -> int:
    """Index of the token closing the group that opens at `tokens[i]`. In a `<` group, `>>` closes two and
    parenthesised or bracketed parts (a default value's expression) are skipped whole."""
    depth, j = 0, i
    while j < len(tokens):
        t = tokens[j].text
        if t == open_:
            depth += 1
        elif t == close:
            depth -= 1
        elif open_ == '<' and t == '>>':
            depth -= 2
        elif open_ == '<' and t in ('(', '['):
            j = _matching(tokens, j, t, ')' if t == '(' else ']')
        if depth <= 0:
            return j
        j += 1
    raise ValueError(f'{tokens[i].path}:{tokens[i].line}: unbalanced {open_!r}')


def split_top_level(tokens: Sequence[Token]) -> List[List[Token]]:
    """Tokens split at the commas outside (), [], {} and template <> groups (a `<` after `=`, in a default value, is
    a comparison)."""
    parts: List[List[Token]] = [[]]
    depth, angle, in_default = 0, 0, False
    for t in tokens:
        x = t.text
        if x in '([{':
            depth += 1
        elif x in ')]}':
            depth -= 1
        elif x == '=' and depth == 0 and angle == 0:
            in_default = True
        elif x == '<' and not in_default:
            angle += 1
        elif x == '>' and not in_default and angle:
            angle -= 1
        elif x == '>>' and not in_default and angle:
            angle = max(0, angle - 2)
        elif x == ',' and depth == 0 and angle == 0:
            parts.append([])
            in_default = False
            continue
        parts[-1].append(t)
    return [p for p in parts if p] if any(parts) else []


def _template_params(tokens: Sequence[Token]) -> Tuple[Tuple[str, str, bool], ...]:
    out = []
    for part in split_top_level(tokens):
        words = [t.text for t in part]
        has_default = '=' in words
        if has_default:
            words = words[:words.index('=')]
        words = [w for w in words if w != '...']
        name = words[-1] if len(words) > 1 else ''
        kind = ' '.join(w for w in words[:-1] if w not in _QUALIFIERS) if name else ' '.join(words)
        out.append(('typename' if kind in ('typename', 'class') else kind, name, has_default))
    return tuple(out)


def _param(part: Sequence[Token], kernel: str) -> CParam:
    words = [t.text for t in part]
    if '=' in words:
        words = words[:words.index('=')]
    array = False
    while words and words[-1] == ']':            # `T name[]` / `T name[N]`: a pointer
        words = words[:words.index('[')] if '[' in words else words[:-1]
        array = True
    if not words or not re.match(r'[A-Za-z_]\w*$', words[-1]) or len(words) < 2 or words[-1] in _INT_WORDS:
        where = f'{part[0].path}:{part[0].line}' if part else kernel
        raise ValueError(f'{where}: {kernel}: parameter `{" ".join(words)}` has no name (the launchers bind by name)')
    name, type_words = words[-1], words[:-1]
    base = tuple(w for w in type_words if w not in _QUALIFIERS and w not in ('*', '&', '&&'))
    base = tuple(w for i, w in enumerate(base) if not (w == '::' or (i + 1 < len(base) and base[i + 1] == '::')))
    return CParam(name, ' '.join(type_words).replace(' *', '*'), array or '*' in type_words, base,
                  '&' in type_words or '&&' in type_words)


def parse(family_or_path, root: Path = KERNELS) -> Source:
    """Parse the translation unit of a family (`'ep_ll'`) or of a `.cu` path, the way the JIT compiles it."""
    root = Path(root)
    path = Path(family_or_path)
    if path.suffix not in ('.cu', '.cuh'):
        path = root / f'{family_or_path}.cu'
    pre = _Preprocessor(root)
    tokens = pre.run(path)
    src = Source(files=[_display(p, root) for p in pre.seen])
    _walk(tokens, src)
    return src


def _walk(tokens: List[Token], src: Source) -> None:
    scopes: List[Optional[str]] = []       # per open brace: a namespace name ('' anonymous), 'extern "C"' or None
    pending_template: Optional[Tuple[Tuple[str, str, bool], ...]] = None
    extern_c_pending = False
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i].text
        if t == 'namespace' and i + 1 < n and tokens[i + 1].text != '=':
            j, names = i + 1, []
            while j < n and tokens[j].text not in ('{', ';', '='):
                if tokens[j].text != '::' and not tokens[j].text.startswith('__'):
                    names.append(tokens[j].text)
                j += 1
            if j < n and tokens[j].text == '{':
                scopes.append('::'.join(names))
                i = j + 1
                continue
            i = j + 1
            continue
        if t == 'extern' and i + 1 < n and tokens[i + 1].text == '"C"':
            if i + 2 < n and tokens[i + 2].text == '{':
                scopes.append('extern "C"')
                i += 3
                continue
            extern_c_pending = True
            i += 2
            continue
        if t == 'template' and i + 1 < n and tokens[i + 1].text == '<':
            end = _matching(tokens, i + 1, '<', '>')
            pending_template = _template_params(tokens[i + 2:end])
            i = end + 1
            continue
        # Aliases and constants end at `;` before any brace (a `{` first: a struct or a function, walked as usual).
        if t == 'typedef' and _at_namespace_scope(scopes) and tokens[_statement_end(tokens, i)].text == ';':
            j = _statement_end(tokens, i)
            words = [x.text for x in tokens[i + 1:j]]
            if len(words) >= 2 and '(' not in words:
                src.typedefs[words[-1]] = tuple(w for w in words[:-1] if w not in _QUALIFIERS)
            i = j + 1
            continue
        if (t == 'using' and i + 2 < n and tokens[i + 2].text == '=' and _at_namespace_scope(scopes)
                and tokens[_statement_end(tokens, i)].text == ';'):
            j = _statement_end(tokens, i)
            src.typedefs[tokens[i + 1].text] = tuple(x.text for x in tokens[i + 3:j] if x.text not in _QUALIFIERS)
            i = j + 1
            continue
        if (t == 'constexpr' and _at_namespace_scope(scopes) and pending_template is None
                and tokens[_statement_end(tokens, i)].text == ';'):
            j = _statement_end(tokens, i)
            _constants(tokens[i + 1:j], src)
            i = j + 1
            continue
        if t == '__global__':
            i = _kernel(tokens, i, scopes, pending_template, extern_c_pending, src)
            pending_template, extern_c_pending = None, False
            continue
        if t == '{':
            scopes.append(None)
            pending_template, extern_c_pending = None, False
        elif t == '}':
            if scopes:
                scopes.pop()
            pending_template, extern_c_pending = None, False
        elif t == ';':
            pending_template, extern_c_pending = None, False
        i += 1


def _at_namespace_scope(scopes: Sequence[Optional[str]]) -> bool:
    return all(s is not None for s in scopes)


def _statement_end(tokens: Sequence[Token], i: int) -> int:
    """Index of the first `;` or `{` from `i` outside parentheses (the last token if neither comes)."""
    depth = 0
    for j in range(i, len(tokens)):
        x = tokens[j].text
        if x == '(':
            depth += 1
        elif x == ')':
            depth -= 1
        elif depth == 0 and x in (';', '{'):
            return j
    return len(tokens) - 1


def _kernel(tokens, i, scopes, template, extern_c, src: Source) -> int:
    """Parse the `__global__` function at `tokens[i]`; returns the index after its parameter list."""
    start, j, n = tokens[i], i + 1, len(tokens)
    name_parts: List[str] = []
    while j < n:
        x = tokens[j].text
        if x in _ATTRIBUTES and j + 1 < n and tokens[j + 1].text == '(':
            j = _matching(tokens, j + 1, '(', ')') + 1
            continue
        if x == '(' and name_parts:
            break
        if x in _DECL_WORDS or x in ('"C"',):
            j += 1
            continue
        if re.match(r'[A-Za-z_]\w*$', x):
            if name_parts and name_parts[-1] != '::':
                name_parts = []          # a return type or attribute word before the name
            name_parts.append(x)
        elif x == '::':
            name_parts.append(x)
        else:
            raise ValueError(f'{start.path}:{start.line}: cannot read the __global__ declaration near {x!r}')
        j += 1
    if j >= n or not name_parts:
        raise ValueError(f'{start.path}:{start.line}: a __global__ without a name')
    end = _matching(tokens, j, '(', ')')
    name = ''.join(name_parts)
    extern_c = extern_c or 'extern "C"' in scopes
    namespaces = [s for s in scopes if s not in (None, 'extern "C"') and s]
    qualname = name if extern_c or name.startswith('::') else '::'.join(namespaces + [name])
    qualname = qualname.lstrip(':')
    parts = split_top_level(tokens[j + 1:end])
    if len(parts) == 1 and [t.text for t in parts[0]] == ['void']:
        parts = []
    params = tuple(_param(p, qualname) for p in parts)
    kernel = CKernel(qualname, template, params, start.path, tokens[j].line, extern_c)
    found = src.kernels.setdefault(qualname, [])
    if all((k.template, k.params) != (kernel.template, kernel.params) for k in found):
        found.append(kernel)
    return end + 1


# ---- namespace-scope constexpr values -------------------------------------------------------------------------------
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.Mod: operator.mod,
           ast.BitXor: operator.xor}


def _constants(tokens: Sequence[Token], src: Source) -> None:
    for part in split_top_level(tokens):
        words = [t.text for t in part]
        if '=' not in words or '(' in words[:words.index('=')]:
            continue                    # a constexpr function or a declaration without a value
        k = words.index('=')
        name, value = words[k - 1], _evaluate(words[k + 1:], src.constants)
        if name in src.constants and src.constants[name] != value:
            src.conflicts.setdefault(name, [src.constants[name]]).append(value)
        src.constants[name] = value


def _evaluate(words: Sequence[str], known: Dict[str, object]):
    """The value of a constant expression of literals and earlier constants (+ - * / % << >> | & ^, parentheses);
    None where it is anything else (a cast, a call, sizeof)."""
    text = []
    for w in words:
        if re.match(r'(0[xX][0-9a-fA-F]+|\d)', w) or w.startswith('.'):
            text.append(re.sub(r'(?<=[0-9a-fA-F.])[uUlLfF]+$', '', w) if not w.lower().startswith('0x')
                        else re.sub(r'[uUlL]+$', '', w))
        elif re.match(r'[A-Za-z_]\w*$', w):
            if w in ('true', 'false'):
                text.append('1' if w == 'true' else '0')
            elif isinstance(known.get(w), (int, float)):
                text.append(repr(known[w]))
            else:
                return None
        elif w in ('+', '-', '*', '/', '%', '<<', '>>', '|', '&', '^', '(', ')', '~'):
            text.append(w)
        else:
            return None
    try:
        tree = ast.parse(' '.join(text), mode='eval')
        return _eval_node(tree.body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError):
        return None


def _eval_node(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else (v if isinstance(node.op, ast.UAdd) else ~v)
    if isinstance(node, ast.BinOp):
        a, b = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Div):
            return int(a / b) if isinstance(a, int) and isinstance(b, int) else a / b     # C truncates
        if type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](a, b)
    raise ValueError('not a constant expression')


# ---- types -------------------------------------------------------------------------------------------------------
def scalar_name(words: Sequence[str]) -> Optional[str]:
    """The numpy scalar name of a resolved C scalar type (`('unsigned', 'int')` -> `'uint32'`), None if not one.
    Device code is LP64: `long` is 64-bit; plain `char` is signed."""
    words = list(words)
    if words in (['float'], ['double'], ['bool']):
        return {'float': 'float32', 'double': 'float64', 'bool': 'bool'}[words[0]]
    if not words or not set(words) <= _INT_WORDS:
        return None
    unsigned = 'unsigned' in words
    if 'char' in words:
        bits = 8
    elif 'short' in words:
        bits = 16
    elif 'long' in words:
        bits = 64
    else:
        bits = 32
    return f'{"u" if unsigned else ""}int{bits}'


# ---- name expressions and the comparison -----------------------------------------------------------------------------
def split_name_expression(expr: str) -> Tuple[str, Optional[List[str]]]:
    """`'deepep::agrs_reduce_kernel<2, true, false>'` -> `('deepep::agrs_reduce_kernel', ['2', 'true', 'false'])`;
    a plain name gives `(name, None)`."""
    expr = expr.strip()
    if '<' not in expr:
        return expr.lstrip(':'), None
    name, rest = expr.split('<', 1)
    if not rest.rstrip().endswith('>'):
        raise ValueError(f'name expression {expr!r}: no closing >')
    inner = rest.rstrip()[:-1]
    args = [' '.join(t.text for t in part) for part in split_top_level(tokenize(inner))]
    return name.strip().lstrip(':'), args


def _kind_name(kind) -> str:
    if isinstance(kind, str):
        return kind
    import numpy as np
    return np.dtype(kind).name


def check_spec(spec, src: Source) -> List[str]:
    """Every difference between `spec` (a `KernelSpec`: family, name expression, params) and its C++ kernel in `src`,
    as sentences naming the kernel, the position and both sides."""
    try:
        qualname, args = split_name_expression(spec.name)
    except ValueError as e:
        return [f'{spec.name}: {e}']
    found = src.kernels.get(qualname)
    if not found:
        near = sorted(k for k in src.kernels if k.split('::')[-1] == qualname.split('::')[-1])
        hint = f' (found {near})' if near else ''
        return [f'{spec.name}: no __global__ {qualname} in {spec.family}.cu or its includes{hint}']
    if len(found) > 1:
        return [f'{spec.name}: {qualname} is declared {len(found)} ways ({", ".join(k.where for k in found)})']
    kernel = found[0]
    out: List[str] = []
    subst = _template_arguments(spec.name, kernel, args, src, out)
    params = kernel.params
    if len(params) != len(spec.params):
        out.append(f'{spec.name} ({kernel.where}): the spec declares {len(spec.params)} parameters, the kernel has '
                   f'{len(params)}: spec {list(spec.param_names)}, C++ {[p.name for p in params]}')
    for i, (p, c) in enumerate(zip(spec.params, params)):
        kind = _kind_name(p.kind)
        if c.reference:
            got = 'a reference'
        elif c.pointer:
            got = 'ptr'
        else:
            got = scalar_name(src.resolve(c.base, subst)) or f'unknown type {" ".join(c.base)!r}'
        if p.name != c.name or kind != got:
            out.append(f'{spec.name} ({kernel.where}): parameter {i}: spec {p.name}: {kind}, '
                       f'C++ {c.name}: {c.spelling} ({got})')
    for i in range(len(spec.params), len(params)):
        out.append(f'{spec.name} ({kernel.where}): parameter {i}: spec (none), C++ {params[i].name}: '
                   f'{params[i].spelling}')
    for i in range(len(params), len(spec.params)):
        out.append(f'{spec.name} ({kernel.where}): parameter {i}: spec {spec.params[i].name}: '
                   f'{_kind_name(spec.params[i].kind)}, C++ (none)')
    return out


def _template_arguments(expr: str, kernel: CKernel, args, src: Source, out: List[str]) -> Dict[str, Tuple[str, ...]]:
    """Check the name expression's template arguments against the kernel's template head; the `typename`
    substitutions for its parameter types."""
    head = kernel.template
    if head is None:
        if args is not None:
            out.append(f'{expr} ({kernel.where}): {kernel.qualname} is not a template, the name expression gives '
                       f'{len(args)} template arguments')
        return {}
    args = args or []
    required = sum(1 for _, _, has_default in head if not has_default)
    if not required <= len(args) <= len(head):
        out.append(f'{expr} ({kernel.where}): {len(args)} template arguments, the kernel takes '
                   f'{required if required == len(head) else f"{required} to {len(head)}"} '
                   f'({", ".join(f"{k} {n}" for k, n, _ in head)})')
    subst = {}
    for i, ((kind, name, _), arg) in enumerate(zip(head, args)):
        if kind == 'typename':
            words = tuple(arg.split())
            if scalar_name(src.resolve(words)) is None and not re.match(r'[A-Za-z_][\w:]*$', arg):
                out.append(f'{expr} ({kernel.where}): template argument {i} ({name}) is a type, got {arg!r}')
            subst[name] = words
            continue
        value = _evaluate(tokenize_words(arg), src.constants)
        if kind == 'bool':
            ok = arg in ('true', 'false')
        else:
            ok = (isinstance(value, int) and arg not in ('true', 'false')
                  and scalar_name(src.resolve(tuple(kind.split()))) not in (None, 'bool'))
        if not ok:
            out.append(f'{expr} ({kernel.where}): template argument {i} ({kind} {name}) got {arg!r}')
    return subst


def tokenize_words(text: str) -> List[str]:
    return [t.text for t in tokenize(text)]


# ---- everything the package declares ---------------------------------------------------------------------------------
def shipped_specs():
    """Family -> every `KernelSpec` the package may load (`deepep_cupy.buffers.shipped`)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from deepep_cupy.buffers import shipped
    return shipped.shipped_specs()


def check_all(specs_by_family: Optional[Dict[str, Sequence]] = None, root: Path = KERNELS) -> Tuple[int, List[str]]:
    """`(number of specs checked, mismatches)` over every family (default: every shipped spec)."""
    specs_by_family = shipped_specs() if specs_by_family is None else specs_by_family
    problems, count = [], 0
    for family, specs in sorted(specs_by_family.items()):
        src = parse(family, root)
        for spec in specs:
            count += 1
            problems.extend(check_spec(spec, src))
    return count, problems


def spec_sites(package: Path = ROOT / 'deepep_cupy') -> List[Tuple[str, int, Optional[str]]]:
    """Every `KernelSpec(...)` call in the package's source: `(file, line, pattern)`, the pattern a regular
    expression that the name expressions it makes match (its f-string's fields as `.+`), None where the name is not
    a literal or an f-string."""
    out = []
    for path in sorted(package.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else (func.attr if isinstance(func, ast.Attribute) else '')
            if fname != 'KernelSpec':
                continue
            arg, pattern = node.args[1], None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                pattern = re.escape(arg.value)
            elif isinstance(arg, ast.JoinedStr):
                pattern = ''.join(re.escape(v.value) if isinstance(v, ast.Constant) else '.+' for v in arg.values)
            out.append((str(path.relative_to(ROOT)), node.lineno, pattern))
    return out


def kernels_in_tree(root: Path = KERNELS) -> Dict[str, CKernel]:
    """Every `__global__` of every family's translation unit, by qualified name."""
    out: Dict[str, CKernel] = {}
    for path in sorted(root.glob('*.cu')):
        for name, kernels in parse(path, root).kernels.items():
            out.setdefault(name, kernels[0])
    return out


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.parse_args(argv)
    specs = shipped_specs()
    count, problems = check_all(specs)
    for p in problems:
        print(p)
    kernels = {s.name.split('<')[0] for v in specs.values() for s in v}
    print(f'{count} specs of {len(kernels)} kernels in {len(specs)} families checked against kernels_cu/: '
          f'{len(problems)} mismatches')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
