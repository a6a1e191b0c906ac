package sock

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

func TestRemoveStale(t *testing.T) {
	dir := t.TempDir()
	if err := RemoveStale(filepath.Join(dir, "absent.sock")); err != nil {
		t.Fatalf("absent: %v", err)
	}
	// A socket whose listener is gone without removing it, as a killed container leaves it.
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	if err := RemoveStale(stale); err != nil {
		t.Fatalf("stale socket: %v", err)
	}
	if _, err := os.Lstat(stale); !os.IsNotExist(err) {
		t.Fatalf("stale socket still there: %v", err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := RemoveStale(file); err == nil {
		t.Fatal("a regular file was accepted")
	}
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("the regular file is gone: %v", err)
	}
}
