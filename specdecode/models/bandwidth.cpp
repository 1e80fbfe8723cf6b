// How fast this machine reads memory, for the limit `speed` sets beside a decoding step.
//
// A core reading one run of memory front to back stops short of what the memory system
// can deliver on some CPUs (AMD EPYC Zen 2: about 12 GB/s a core), while the same core
// reading several runs far apart side by side gets more (18-21 GB/s there); the quantized
// products read their weights so on such CPUs (quant_linear.cpp, WEIGHT_STREAMS). A limit
// taken from one run a thread would flatter a kernel that reads several. read_streams
// reads a buffer with each thread's share cut into `streams` runs taken 64 bytes of each
// in turn, and returns a checksum of what it read, so that no read can be left out.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// The sum of the 64-bit words in [p, p + bytes), bytes a multiple of 8, wrapping.
uint64_t sum_words(const uint8_t* p, int64_t bytes) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    sum += word;
  }
  return sum;
}

}  // namespace

// The wrapping sum of `buffer`'s int64 values (its bytes a multiple of 8), read as above.
int64_t read_streams(torch::Tensor buffer, int64_t streams) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.nbytes() % 8 == 0, "buffer: contiguous, a multiple of 8 bytes");
  TORCH_CHECK(streams >= 1 && streams <= 64, "streams: 1 to 64");
  const uint8_t* data = static_cast<const uint8_t*>(buffer.data_ptr());
  const int64_t bytes = static_cast<int64_t>(buffer.nbytes()), threads = at::get_num_threads();
  std::vector<uint64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = bytes * t / threads / 64 * 64;
      const int64_t end = t + 1 == threads ? bytes : bytes * (t + 1) / threads / 64 * 64;
      const int64_t run = (end - begin) / streams / 64 * 64;  // each stream's bytes, whole lines
      __m256i acc = _mm256_setzero_si256();
      for (int64_t at = 0; at < run; at += 64)
        for (int64_t s = 0; s < streams; ++s) {
          const uint8_t* line = data + begin + s * run + at;
          acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
          acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
        }
      alignas(32) uint64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
      const int64_t tail = begin + streams * run;  // what the runs left over, read plainly
      sums[t] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words(data + tail, end - tail);
    }
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return static_cast<int64_t>(total);
}
