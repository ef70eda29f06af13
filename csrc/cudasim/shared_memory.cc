#include "cudasim/shared_memory.h"

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "cudasim/launch.h"

namespace cudasim {
namespace {

using Range = std::pair<size_t, size_t>;  // [offset, end) in the executable's TLS segment

// Function-local thread_local variables of the executable (_ZZ...), except the simulator's own
// (namespace cudasim), merged into ranges. Empty when the symbol table is stripped.
std::vector<Range> read_ranges() {
  std::vector<Range> out;
  const int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  struct stat st;
  void* map = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(Elf64_Ehdr))) {
    map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  }
  close(fd);
  if (map == MAP_FAILED) return out;
  const char* base = static_cast<const char*>(map);
  const size_t size = static_cast<size_t>(st.st_size);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  const bool ok = std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 &&
                  eh->e_ident[EI_CLASS] == ELFCLASS64 && eh->e_shoff != 0 &&
                  eh->e_shoff + uint64_t{eh->e_shnum} * sizeof(Elf64_Shdr) <= size;
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + (ok ? eh->e_shoff : 0));
  for (int i = 0; ok && i < eh->e_shnum; ++i) {
    if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
    const Elf64_Shdr& strtab = sh[sh[i].sh_link];
    if (sh[i].sh_offset + sh[i].sh_size > size || strtab.sh_offset + strtab.sh_size > size) break;
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
    const size_t count = sh[i].sh_size / sizeof(Elf64_Sym);
    for (size_t k = 0; k < count; ++k) {
      const Elf64_Sym& s = syms[k];
      if (ELF64_ST_TYPE(s.st_info) != STT_TLS || s.st_size == 0 || s.st_name >= strtab.sh_size) {
        continue;
      }
      const char* name = base + strtab.sh_offset + s.st_name;
      if (std::strncmp(name, "_ZZ", 3) != 0 || std::strncmp(name, "_ZZN7cudasim", 12) == 0) {
        continue;
      }
      out.emplace_back(s.st_value, s.st_value + s.st_size);
    }
  }
  munmap(map, size);
  std::sort(out.begin(), out.end());
  std::vector<Range> merged;
  for (const Range& r : out) {
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

const std::vector<Range>& ranges() {
  static const std::vector<Range>* r = new std::vector<Range>(read_ranges());
  return *r;
}

int find_tls(dl_phdr_info* info, size_t, void* out) {
  // The first object is the executable, whose static TLS block every thread has.
  *static_cast<char**>(out) = static_cast<char*>(info->dlpi_tls_data);
  return 1;
}

}  // namespace

void fill_shared_memory(unsigned char byte) {
  static thread_local char* tls = [] {
    char* p = nullptr;
    dl_iterate_phdr(&find_tls, &p);
    return p;
  }();
  if (tls == nullptr) return;
  for (const Range& r : ranges()) std::memset(tls + r.first, byte, r.second - r.first);
}

size_t shared_memory_bytes() {
  size_t n = 0;
  for (const Range& r : ranges()) n += r.second - r.first;
  return n;
}

}  // namespace cudasim
