// Robust statistics for telemetry: median, median absolute deviation, and an exponentially
// weighted mean that rejects outliers and follows level shifts (change points).
//
// All functions are pure; RobustEwma is a small value type, not thread-safe (callers lock).
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <vector>

namespace parapilot::monitor {

namespace detail {

// Moves the values of [first, last) that satisfy `pred` to the front, without branching on
// them; returns the end of those.
template <class Pred>
double* partition_branch_free(double* first, double* last, Pred pred) {
  double* end = first;
  for (double* p = first; p != last; ++p) {
    const double v = *p;
    *p = *end;
    *end = v;
    end += pred(v);
  }
  return end;
}

// Moves *p left into the sorted [first, p), keeping [first, p] sorted.
inline void insert_sorted(double* first, double* p) {
  const double v = *p;
  for (; p != first && v < p[-1]; --p) *p = p[-1];
  *p = v;
}

// select_nth for a few values (first <= kth < last): sorts [first, kth] by insertion, then
// swaps each later value below *kth in and sinks it to its place, so that [first, kth] always
// holds the smallest values seen, sorted. O(n^2) comparisons at worst: for the small windows
// and node groups this handles, fewer instructions than std::nth_element's partitioning.
inline void select_few(double* first, double* kth, double* last) {
  for (double* p = first + 1; p <= kth; ++p) insert_sorted(first, p);
  for (double* p = kth + 1; p < last; ++p) {
    if (!(*p < *kth)) continue;
    std::swap(*p, *kth);
    insert_sorted(first, kth);
  }
}

// The median of a, b and c (none NaN).
inline double median3(double a, double b, double c) {
  return std::max(std::min(a, b), std::min(std::max(a, b), c));
}

}  // namespace detail

/// std::nth_element(first, kth, last) for values that are not NaN: reorders [first, last) so
/// that *kth is the value sorting would put there, none before it larger and none after it
/// smaller (of equal values, such as 0 and -0, any may end there, as with std::nth_element).
/// The partitions do not branch on the values: on unordered measurements every comparison is a
/// coin toss, and mispredicted branches would cost more than the comparisons.
inline void select_nth(double* first, double* kth, double* last) {
  constexpr std::ptrdiff_t kFew = 16;  // no more values: detail::select_few
  constexpr int kMaxRounds = 64;       // pivots this bad: std::nth_element, O(n log n) at worst
  if (kth >= last) return;
  for (int round = 0; last - first > kFew && round < kMaxRounds; ++round) {
    const double pivot = detail::median3(*first, first[(last - first) / 2], last[-1]);
    // [first, less) < pivot <= [less, last).
    double* less = detail::partition_branch_free(first, last, [=](double v) { return v < pivot; });
    if (kth < less) {
      last = less;
      continue;
    }
    if (less != first) {
      first = less;
      continue;
    }
    // Nothing was below the pivot, the smallest value: split off the values equal to it,
    // [first, equal) (never empty), so that the range shrinks.
    double* equal =
        detail::partition_branch_free(first, last, [=](double v) { return !(pivot < v); });
    if (kth < equal) return;
    first = equal;
  }
  if (last - first <= kFew) {
    detail::select_few(first, kth, last);
  } else {
    std::nth_element(first, kth, last);
  }
}

/// Median of [first, last) (the mean of the two middle values for an even count), reordering
/// the range; 0 for an empty one. Precondition: no NaN.
inline double median_in_place(double* first, double* last) {
  if (first == last) return 0.0;
  const std::ptrdiff_t size = last - first;
  double* mid = first + size / 2;
  select_nth(first, mid, last);
  const double upper = *mid;
  if (size % 2 == 1) return upper;
  const double lower = *std::max_element(first, mid);
  return 0.5 * (lower + upper);
}

/// Median of `v` (the mean of the two middle values for an even count); 0 for an empty input.
inline double median(std::vector<double> v) { return median_in_place(v.data(), v.data() + v.size()); }

/// Median absolute deviation of `v` around `center`; 0 for an empty input.
inline double mad(const std::vector<double>& v, double center) {
  std::vector<double> d;
  d.reserve(v.size());
  for (double x : v) d.push_back(std::abs(x - center));
  return median(std::move(d));
}

/// An EWMA with outlier rejection. A sample farther than `reject_k` robust deviations (1.4826 x
/// MAD of the recent window, at least `rel_floor` x the level) from the current level is an
/// outlier and is not averaged in; `confirm` outliers in a row on the same side are a level
/// shift, and the level jumps to their median (a momentary blip never moves it).
class RobustEwma {
 public:
  struct Options {
    double alpha = 0.3;       ///< weight of a new inlier sample.
    double reject_k = 4.0;    ///< outlier threshold in robust deviations (> 0).
    double rel_floor = 0.05;  ///< deviation floor relative to the level (>= 0; noise-free inputs).
    int confirm = 3;          ///< same-side outliers in a row that shift the level (1 to 16).
    int window = 9;           ///< recent inliers kept for the MAD (1 to 16).
  };

  RobustEwma() = default;
  explicit RobustEwma(Options options)
      : o_(options),
        capacity_(std::clamp(options.window, 1, kMaxWindow)),
        confirm_(std::clamp(options.confirm, 1, kMaxPending)),
        keep_(1 - options.alpha) {
    // Preconditions add() relies on (its outlier test counts deviations instead of selecting
    // their median only for a positive threshold and a non-negative floor).
    assert(options.reject_k > 0 && options.rel_floor >= 0);
  }

  /// Adds a sample; returns false when it was rejected as an outlier (it may still complete a
  /// level shift, in which case the level moves and true is returned).
  bool add(double x) {
    if (count_ == 0) {
      level_ = x;
      ++count_;
      push(x);
      return true;
    }
    const double dev = x - level_;
    const double floor = o_.rel_floor * std::abs(level_);
    // Within reject_k floors of the level a sample is an inlier whatever the MAD: skip it.
    const bool near = std::abs(dev) <= o_.reject_k * floor;
    if (!near && beyond_spread(std::abs(dev), floor)) {
      const int side = dev > 0 ? 1 : -1;
      if (side != outlier_side_) pending_size_ = 0;
      outlier_side_ = side;
      pending_[pending_size_++] = x;
      ++rejected_;
      if (pending_size_ >= confirm_) {
        // The median reorders a copy: the window takes the outliers in arrival order.
        std::array<double, kMaxPending> sorted = pending_;
        level_ = median_in_place(sorted.data(), sorted.data() + pending_size_);
        size_ = head_ = 0;
        for (int i = 0; i < pending_size_; ++i) push(pending_[i]);
        pending_size_ = 0;
        outlier_side_ = 0;
        ++shifts_;
        return true;
      }
      return false;
    }
    pending_size_ = 0;
    outlier_side_ = 0;
    level_ = keep_ * level_ + o_.alpha * x;
    push(x);
    ++count_;
    return true;
  }

  double value() const { return level_; }
  /// Robust standard deviation of the recent inliers around the level (1.4826 x their MAD); 0
  /// until two samples are in.
  double spread() const { return size_ > 1 ? 1.4826 * window_mad() : 0.0; }
  /// Standard error of the level for independent samples of that spread: an EWMA of weight
  /// alpha has variance alpha / (2 - alpha) of its samples'.
  double standard_error() const { return spread() * std::sqrt(o_.alpha / (2 - o_.alpha)); }
  long count() const { return count_; }  ///< samples accepted (inliers and shifts' first).
  long rejected() const { return rejected_; }
  long shifts() const { return shifts_; }
  /// Forgets every sample; the options stay.
  void reset() {
    // The buffers are only read below size_ and pending_size_: their contents may stay.
    level_ = 0;
    count_ = rejected_ = shifts_ = 0;
    outlier_side_ = 0;
    size_ = head_ = pending_size_ = 0;
  }

 private:
  static constexpr int kMaxWindow = 16;
  static constexpr int kMaxPending = 16;
  // Appends to the window of recent inliers, dropping the oldest beyond its capacity. The ring
  // only turns once full (head_ leaves 0 only then, and both restart together), so a window
  // not yet full starts at 0.
  void push(double x) {
    const int cap = capacity_;
    if (size_ < cap) {
      window_[size_++] = x;
    } else {
      window_[head_] = x;
      if (++head_ == cap) head_ = 0;
    }
  }
  // Whether a sample `abs_dev` > reject_k * floor off the level is an outlier: abs_dev >
  // reject_k * spread for spread = max(1.4826 x the window's MAD, floor), and spread > 0.
  bool beyond_spread(double abs_dev, double floor) const {
    // As reject_k > 0 and rounding is monotone, reject_k * max(a, floor) = max(reject_k * a,
    // reject_k * floor), and abs_dev exceeds the second: the test is abs_dev > reject_k *
    // (1.4826 * mad). That holds for a deviation d whenever it holds for a larger one, so for
    // an odd window, whose MAD is its middle deviation, it holds for the MAD iff it holds for
    // more than half of the deviations: a count instead of a selection. With floor > 0 the
    // spread is > 0.
    if (size_ % 2 == 1 && floor > 0) {
      int below = 0;
      for (int i = 0; i < size_; ++i) {
        below += abs_dev > o_.reject_k * (1.4826 * std::abs(window_[i] - level_));
      }
      return below > size_ / 2;
    }
    const double spread = std::max(1.4826 * window_mad(), floor);
    return abs_dev > o_.reject_k * spread && spread > 0;
  }
  // MAD of the window around the level, without allocating.
  double window_mad() const {
    std::array<double, kMaxWindow> d;  // only the first size_ are used
    for (int i = 0; i < size_; ++i) d[i] = std::abs(window_[i] - level_);
    return median_in_place(d.data(), d.data() + size_);
  }

  Options o_;
  // o_.window and o_.confirm clamped to their ranges, worked out once (add() is per sample).
  int capacity_ = Options{}.window;
  int confirm_ = Options{}.confirm;
  double keep_ = 1 - Options{}.alpha;  // the level's weight in an update, 1 - o_.alpha
  double level_ = 0;
  long count_ = 0;
  long rejected_ = 0;
  long shifts_ = 0;
  int outlier_side_ = 0;
  std::array<double, kMaxWindow> window_{};  // a ring of size_ recent inliers from head_
  int size_ = 0;
  int head_ = 0;
  int pending_size_ = 0;
  std::array<double, kMaxPending> pending_{};  // the first pending_size_: outliers in a row
};

}  // namespace parapilot::monitor
