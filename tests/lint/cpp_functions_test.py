"""The C++ function finder of the size check on the constructs that mislead one.

Each case is a piece of C++ and the functions it defines, as
(name, first line, last line). Run: cpp_functions_test.py
"""
import sys

from cpp_functions import find_functions
from cpp_lex import lex

CASES = [
    ("namespaces and classes are not functions; inline methods are",
     """namespace ckpt {
namespace {
class Pool {
 public:
  int size() const { return n_; }
 private:
  int n_ = 0;
};
}  // namespace
}  // namespace ckpt
""", [("Pool::size", 5, 5)]),
    ("braces in comments, strings, character literals and raw strings",
     """int F() {
  // a } in a comment
  /* and { here */
  const char* s = "}}";
  char c = '}';
  const char* raw = R"x(
}   )" still inside
)x";
  return 1'000'000;
}
int G() { return '{'; }
""", [("F", 1, 10), ("G", 11, 11)]),
    ("a lambda counts toward the function it is in",
     """void Outer() {
  auto f = [](int x) {
    return x;
  };
  f(1);
}
""", [("Outer", 1, 6)]),
    ("out-of-line members, destructors, operators, a multi-line signature",
     """Engine::~Engine() {}
Claim& Claim::operator=(Claim&& other) noexcept {
  return *this;
}
bool operator==(const A& a, const A& b) { return true; }
Foo::operator bool() const { return ok_; }
int Functor::operator()(int x) const { return x; }
absl::Status Engine::Register(const Request& request,
                              Response* response) ABSL_LOCKS_EXCLUDED(mu_) {
  return absl::OkStatus();
}
""", [("Engine::~Engine", 1, 1), ("Claim::operator=", 2, 4), ("operator==", 5, 5),
      ("Foo::operator bool", 6, 6), ("Functor::operator()", 7, 7),
      ("Engine::Register", 8, 11)]),
    ("constructor initializer lists with braces",
     """Server::Server(Options options)
    : options_(std::move(options)),
      pool_{options_.pool_bytes},
      names_{} {
  Start();
}
""", [("Server::Server", 1, 6)]),
    ("initializers, enums and brace-initialised members are skipped",
     """const std::vector<Option> kOptions = {{"a", 1}, {"b", 2}};
constexpr Limits kLimits{1, 2};
enum class Mode : int { kOff, kOn };
struct Point { int x{0}; int y = {1}; std::function<void()> cb_{}; };
extern "C" {
void Hook() { }
}
""", [("Hook", 6, 6)]),
    ("templates, attributes, macros in front, and preprocessor lines",
     """#define BLOCK(x) { x; }
template <typename T>
[[nodiscard]] T Twice(T x) {
  return x + x;
}
ABSL_MUST_USE_RESULT int Checked() {
#if defined(FOO)
  if (a) {
#else
  if (b) {
#endif
    return 1;
  }
  return 0;
}
""", [("Twice", 3, 5), ("Checked", 6, 15)]),
    ("macros that define functions",
     """TEST(PoolTest, Grows) {
  EXPECT_TRUE(true);
}
void CKPT_WRAP(Lock)(Mutex* mu) {
  mu->Lock();
}
""", [("TEST(PoolTest,Grows)", 1, 3), ("CKPT_WRAP(Lock)", 4, 6)]),
    ("a struct with alignas, a nested class and a function returning a struct",
     """struct alignas(64) Slot {
  struct Inner {
    void Touch() {}
  };
};
struct tm* LocalTime(time_t t) { return nullptr; }
""", [("Slot::Inner::Touch", 3, 3), ("LocalTime", 6, 6)]),
    ("a default argument holding a lambda, and a CUDA kernel",
     """void Visit(std::function<void()> f = [] {}) {
  f();
}
__global__ void __launch_bounds__(256) DriftKernel(const float* w, int n) {
  kernel<<<1, 2>>>(w);
}
""", [("Visit", 1, 3), ("DriftKernel", 4, 6)]),
]


def lexer_cases():
    """Comments come back with their lines, text of strings is not a comment."""
    failures = []
    _, comments = lex('int a; // one\n/* two\nlines */ const char* s = "// no";\n')
    got = [(c.line, c.end_line, c.text.strip()) for c in comments]
    want = [(1, 1, "one"), (2, 3, "two\nlines")]
    if got != want:
        failures.append(f"lexer comments: got {got}, want {want}")
    tokens, _ = lex('#include "a.h" // x\nint b;\n')
    if [t.text for t in tokens] != ["int", "b", ";"]:
        failures.append(f"lexer: preprocessor tokens kept: {[t.text for t in tokens]}")
    return failures


def main():
    failures = lexer_cases()
    for title, source, want in CASES:
        got = [tuple(f) for f in find_functions(source)]
        if got != want:
            failures.append(f"{title}:\n  got  {got}\n  want {want}")
    if failures:
        print("cpp_functions_test FAILED:\n" + "\n".join(failures))
        return 1
    print(f"cpp_functions_test: {len(CASES)} cases and the lexer passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
