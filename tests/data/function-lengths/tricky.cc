// Fixture for scripts/function-lengths.py (run with --max 10); expected.txt lists what it reports.
// Braces in comments, strings, characters and raw strings must not count: { { {
#include <string>
#define OPEN_BRACE {

namespace fixture {

/* a block comment with a brace { that never closes */
int short_function(int x) {
  return x + 1;
}

// 11 lines, from its brace to its closing brace: reported.
std::string long_with_literals(char c) {
  std::string s = "}}} not a brace {";
  char open = '{';
  char quote = '\'';
  std::string raw = R"json({"a": {"b": "}"}})json";
  std::string raw2 = R"(})";
  int million = 1'000'000;
  if (c == '}') s += "\"}\"";
  s += open + quote + raw + raw2;
  return s + std::to_string(million);
}

// A lambda counts towards its enclosing function: 11 lines, reported.
int with_lambda(int n) {
  auto add = [n](int k) {
    int total = 0;
    for (int i = 0; i < k; ++i) {
      total += i * n;
    }
    return total;
  };
  int r = add(3);
  return r;
}

class Widget {
 public:
  // A constructor with braces in its initializer list: 11 lines, reported.
  Widget(int a, int b) : a_{a}, b_(b), c_{a + b} {
    a_ += 1;
    b_ += 2;
    c_ += 3;
    a_ *= 2;
    b_ *= 2;
    c_ *= 2;
    a_ -= 1;
    b_ -= 1;
    c_ -= 1;
  }
  int sum() const noexcept { return a_ + b_ + c_; }
  // 11 lines with a trailing return type and const: reported.
  auto scaled(int k) const -> int {
    int v = a_;
    v *= k;
    v += b_;
    v *= k;
    v += c_;
    v *= k;
    v += 1;
    v -= 1;
    return v;
  }

 private:
  int a_{0};
  int b_ = 0;
  int c_{};
};

}  // namespace fixture

// Exactly 10 lines: at the limit, not reported.
int Widget_free(int x) {
  x += 1;
  x += 2;
  x += 3;
  x += 4;
  x += 5;
  x += 6;
  x += 7;
  return x;
}

const int kTable[] = {
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
};

bool fixture_operator_test();
struct Point {
  int x, y;
  // 11 lines: reported under its operator name.
  bool operator==(const Point& o) const {
    bool same = true;
    same = same && x == o.x;
    same = same && y == o.y;
    same = same && x == o.x;
    same = same && y == o.y;
    same = same && x == o.x;
    same = same && y == o.y;
    same = same && x == o.x;
    return same;
  }
};
